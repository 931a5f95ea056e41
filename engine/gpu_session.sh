#!/usr/bin/env bash
# One device call per phase, each within the 10-minute cap, every result in a file under $OUT
# (vLLM's shutdown logging floods a piped tail). Run through engine/vllm_device.sh after staging:
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh check'      # GPU tests + float32 exactness
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh fresh'      # bf16 speed on fresh, its best budget
#       recorded (assets/budgets.json, brought back), then the app on it (carry [".whl"]: gradio's wheels)
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh humaneval'  # bf16 speed on HumanEval; the compiled step
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh shape'      # Qwen3-8B shape, random weights + projection
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh hybrid'     # tiny Qwen3.5: float32 exactness with a
#       scripted drafter (deep acceptance), vLLM's GDN kernels under the tree tests; then, in the next call
#       while the machine is warm, 'hybrid-cost': verify cost vs tree size, hybrid vs all-attention
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh shape27'    # Qwen3.6-27B hybrid shape, random weights
#   bash engine/vllm_device.sh 'bash engine/gpu_session.sh exact'      # float32 exactness at Qwen3-1.7B's shape,
#       a drafter scripted with the first run's own outputs (engine.scripted) so trees go deep
# LIMIT (prompts per bench) and TOKENS override the defaults.
set -uo pipefail
phase=${1:?phase: check, fresh, humaneval, shape, hybrid, hybrid-cost, shape27 or exact}
TOKENS=${TOKENS:-128}
bench() { python3 -m engine.bench --engine vllm --no-progress "$@"; }
tables() { grep -E '^\||^kernels|NOT a near-tie|^error' "$1" | tail -n "${2:-40}"; }

case "$phase" in
check)
  timeout 330 python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider tests/test_fixed_step_gpu.py \
      tests/test_vllm_engine.py > "$OUT/pytest.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest.txt" | tail -n 20
  timeout 230 bench $MODELS --native ar --dtype float32 --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-40}" \
      --methods ar,dflash,ddtree --tree-budget 32 --max-new-tokens "$TOKENS" \
      --out "$OUT/gpu-vllm-fresh-float32.json" > "$OUT/bench-float32.txt" 2>&1
  tables "$OUT/bench-float32.txt" 12 ;;
fresh)
  timeout 300 bench $MODELS --native ar,dflash --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-24}" \
      --methods ar,dflash,ddtree --tree-budget 16,32,64,128 --max-new-tokens "$TOKENS" --reduced-traces \
      --count-kernels --out "$OUT/gpu-vllm-fresh.json" > "$OUT/bench-fresh.txt" 2>&1
  tables "$OUT/bench-fresh.txt"
  python3 -m engine.calibration record "$OUT/gpu-vllm-fresh.json" && cp assets/budgets.json "$OUT/budgets.json"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl > "$OUT/pip.txt" 2>&1
  timeout 220 python3 -m engine.app_check --launch "python3 app.py --engine vllm $MODELS" --limit 5 \
      --max-new-tokens 64 --out "$OUT/app-check.json" > "$OUT/app-check.txt" 2>&1
  grep -E '^page|^default|engine vllm|^sweep|^  [0-9]' "$OUT/app-check.txt" | tail -n 25 ;;
humaneval)
  timeout 330 bench $MODELS --native ar,dflash --prompts assets/prompts/humaneval.jsonl --limit 20 \
      --methods ar,dflash,ddtree --tree-budget 16,32,64,128 --max-new-tokens "$TOKENS" \
      --out "$OUT/gpu-vllm-humaneval.json" > "$OUT/bench-humaneval.txt" 2>&1
  tables "$OUT/bench-humaneval.txt" 20
  timeout 220 bench $MODELS --compile-step --prompts assets/prompts/fresh.jsonl --limit 12 \
      --methods ar,dflash,ddtree --tree-budget 32,64 --max-new-tokens "$TOKENS" --count-kernels \
      --out "$OUT/gpu-vllm-fresh-compiled.json" > "$OUT/bench-compiled.txt" 2>&1
  tables "$OUT/bench-compiled.txt" 20 ;;
shape)
  timeout 420 bench --random-weights --model assets/shapes/qwen3-8b --drafter assets/shapes/qwen3-8b-dflash-b16 \
      --native ar --gpu-memory-utilization 0.4 --prompts assets/prompts/fresh.jsonl --limit 5 \
      --methods ar,dflash,ddtree --tree-budget 16,32,64,128,256,512 --max-new-tokens "$TOKENS" \
      --out "$OUT/gpu-qwen3-8b-random.json" > "$OUT/bench-shape.txt" 2>&1
  tables "$OUT/bench-shape.txt" 15
  python3 -m engine.projection "$OUT/gpu-qwen3-8b-random.json" | tee "$OUT/projection.txt" ;;
hybrid)
  hybrid=/tmp/tiny-qwen3.5 attention=/tmp/tiny-qwen3.5-attention scripted=/tmp/tiny-qwen3.5-scripted
  { python3 -m tests.hybrid_models "$hybrid" --vllm-shape
    python3 -m tests.hybrid_models "$attention" --vllm-shape --attention-only
    python3 -m tests.hybrid_models --scripted-drafter "$scripted" --model "$hybrid" \
        --prompts assets/prompts/fresh.jsonl --limit 12 --max-new-tokens 64; } > "$OUT/hybrid-build.txt" 2>&1
  tail -n 3 "$OUT/hybrid-build.txt"
  timeout 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_gdn_tree.py > "$OUT/pytest-gdn.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest-gdn.txt" | tail -n 12
  timeout 300 bench --model "$hybrid" --drafter "$scripted" --dtype float32 --native ar --prompts \
      assets/prompts/fresh.jsonl --limit 12 --methods ar,dflash,ddtree --tree-budget 16,64 --max-new-tokens 64 \
      --out "$OUT/gpu-vllm-hybrid-float32.json" > "$OUT/bench-hybrid.txt" 2>&1
  tables "$OUT/bench-hybrid.txt" 12
  ;;
hybrid-cost)  # verify cost vs tree size: the same shape with and without its Gated DeltaNets (after hybrid)
  for model in /tmp/tiny-qwen3.5 /tmp/tiny-qwen3.5-attention; do
    timeout 240 bench --model "$model" --drafter /tmp/tiny-qwen3.5-scripted --prompts assets/prompts/fresh.jsonl \
        --limit 3 --methods ar,ddtree --tree-budget 1,4,16,64,256 --max-new-tokens 64 \
        --out "$OUT/gpu-vllm-$(basename "$model")-cost.json" > "$OUT/bench-$(basename "$model")-cost.txt" 2>&1
    tables "$OUT/bench-$(basename "$model")-cost.txt" 8
  done ;;
shape27)
  timeout 540 bench --random-weights --model assets/shapes/qwen3.6-27b --drafter assets/shapes/qwen3.6-27b-dflash-b16 \
      --native ar --gpu-memory-utilization 0.85 --prompts assets/prompts/fresh.jsonl --limit 3 \
      --methods ar,dflash,ddtree --tree-budget 16,64,256 --max-new-tokens 64 \
      --out "$OUT/gpu-qwen3.6-27b-random.json" > "$OUT/bench-shape27.txt" 2>&1
  tables "$OUT/bench-shape27.txt" 12
  python3 -m engine.projection "$OUT/gpu-qwen3.6-27b-random.json" | tee "$OUT/projection27.txt" ;;
exact)
  shape=assets/shapes/qwen3-1.7b drafter=assets/shapes/qwen3-1.7b-dflash-b16 scripted=/tmp/qwen3-1.7b-scripted
  timeout 200 bench --random-weights --model "$shape" --drafter "$drafter" --dtype float32 --native ar \
      --prompts assets/prompts/fresh.jsonl --limit 8 --methods ar --max-new-tokens 64 \
      --out "$OUT/gpu-qwen3-1.7b-random-ar.json" > "$OUT/bench-exact-ar.txt" 2>&1
  python3 -m engine.scripted "$OUT/gpu-qwen3-1.7b-random-ar.json" --shape "$drafter" --out "$scripted"
  timeout 330 bench --random-weights --model "$shape" --drafter "$scripted" --dtype float32 --native ar \
      --prompts assets/prompts/fresh.jsonl --limit 8 --methods ar,dflash,ddtree --tree-budget 16,64 \
      --max-new-tokens 64 --out "$OUT/gpu-qwen3-1.7b-random-float32.json" > "$OUT/bench-exact.txt" 2>&1
  tables "$OUT/bench-exact.txt" 12 ;;
*)
  echo "unknown phase $phase: check, fresh, humaneval, shape, hybrid, hybrid-cost, shape27 or exact" >&2; exit 2 ;;
esac
