#!/usr/bin/env bash
# Train the DFlash drafter for SmolLM2 on the GPU machine. Run the SAME command in two
# back-to-back calls (the machine keeps /tmp while it stays warm, 30 s after a call):
#   call A: install vLLM, convert the GGUF, generate the data, train until the deadline
#   call B: resume training until the deadline
# Every call ends by DEADLINE_MIN minutes after it starts and leaves in $OUT:
#   drafter/          config.json + bf16 safetensors shards (<= 15 MiB each): load_drafter() reads it; and
#                     schedule.json, how far the learning-rate schedule got (--init-from continues it)
#   data-stats.json   the corpus: prompts by family, replies, tokens, the evaluation-overlap report
#   train-log.jsonl   one line per 50 training steps (loss, per-slot accuracy, tau~)
#   run.log           everything printed: stage timings, data stats, training log lines
# Needs in /tmp/stage (staged with ../shared/device/stage.sh): the SmolLM2 GGUF, and vllm-trim.tar.xz and INSTALL.sh
# when the call makes data. A corpus carried back by an earlier call travels whole as corpus-SEED[-more-K].tar.xz:
# it is unpacked into the data folder, and a call that only trains on it needs no vLLM, only a gguf wheel
# (gguf-*.whl) for the GGUF's conversion. Settings by environment: DEADLINE_MIN (9), LATER_MIN (8.3: training
# planned for call B, read by call A only), NUM_PROMPTS (80000 candidates per engine), WORKERS (vLLM engines side by
# side, each with a fixed 16 GiB KV cache: as many as fit in 18 GiB each, at most 6 (a 135M model leaves one engine
# bound by its host-side scheduling, so more engines generate more; an H100 holds 4, an H200 6), DATA_MIN (7: the
# data stage's budget), SEED (0: another seed writes other prompts), MORE_DATA_MIN (0; in a resumed call: first this
# many minutes of new prompts and replies, into more-K/), DRAFTER_BACK (1; 0 keeps the weights on the machine: see
# the end), CORPUS_BACK (0; 1: a data-only call, whose corpus comes back as corpus-SEED[-more-K].tar.xz.part-N, at
# most 4 parts of 15 MiB: see the end). Extra arguments go to engine.training.run and from there to
# engine.training.train (e.g. --init-from DRAFTER_FOLDER to continue a drafter brought back from an earlier
# session).
#     bash engine/training/device.sh
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/../.."  # the repository root: python -m engine... needs it
: "${OUT:?OUT must name the folder whose files come back}"
STAGE=${STAGE:-/tmp/stage}
export SITE=${SITE:-/tmp/site}  # where INSTALL.sh puts vLLM
WORK=${WORK:-/tmp/dflash}
MODEL=${MODEL:-/tmp/smol-hf}
export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HOME=/tmp/home \
       VLLM_CACHE_ROOT=/tmp/vcache TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$WORK" "$HOME"
log="$WORK/run.log"
began_mark="$WORK/call-began"
touch "$began_mark"

say() { echo "== device.sh: $* at $(( $(date +%s) - started )) s"; }

engines_that_fit() {
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  local count=$(( ${mib:-0} / 1024 / 18 ))
  echo $(( count < 1 ? 1 : count > 6 ? 6 : count ))
}

makes_data() {
  [ ! -f "$WORK/data-stats.json" ] || [ "${MORE_DATA_MIN:-0}" != 0 ]
}

prepare() {
  for archive in "$STAGE"/corpus-*.tar.xz; do
    [ -f "$archive" ] || continue
    tar -C "$WORK" -xJf "$archive" && rm "$archive" || return 1
    say "corpus $(basename "$archive") unpacked into $WORK"
  done
  if makes_data && [ ! -d "$SITE/vllm" ]; then
    [ -f "$STAGE/vllm-trim.tar.xz" ] || { say "no $STAGE/vllm-trim.tar.xz: stage the bundle first"; return 1; }
    bash "$STAGE/INSTALL.sh" "$STAGE/vllm-trim.tar.xz" || return 1
    say "vLLM installed"
  fi
  if [ ! -f "$MODEL/config.json" ]; then
    gguf=$(ls "$STAGE"/*.gguf 2>/dev/null | head -n 1)
    [ -n "$gguf" ] || { say "no GGUF in $STAGE: stage SmolLM2-135M-Instruct.Q4_1.gguf first"; return 1; }
    if ! python3 -c "import gguf" 2>/dev/null; then  # the vLLM bundle brings it; a training-only call, a wheel
      wheel=$(ls "$STAGE"/gguf-*.whl 2>/dev/null | head -n 1)
      [ -n "$wheel" ] || { say "no gguf: stage a gguf wheel (pip download --no-deps gguf) or the vLLM bundle"; return 1; }
      python3 -m zipfile -e "$wheel" "$SITE" || return 1  # a pure-Python wheel: unpacking installs it
    fi
    python3 -m engine.models.convert "$gguf" "$MODEL" || return 1
    say "target converted"
  fi
}

{
  say "call started $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
  prepare && python3 -m engine.training.run --model "$MODEL" --out "$WORK" --started-at "$started" \
    --deadline-minutes "${DEADLINE_MIN:-9}" --later-minutes "${LATER_MIN:-8.3}" --num-prompts "${NUM_PROMPTS:-80000}" \
    --data-workers "${WORKERS:-$(engines_that_fit)}" --data-minutes "${DATA_MIN:-7}" --data-seed "${SEED:-0}" \
    --more-data-minutes "${MORE_DATA_MIN:-0}" $([ "${CORPUS_BACK:-0}" = 1 ] && echo --data-only) "$@"
  status=$?
  echo "$status" > "$WORK/status"
  say "pipeline exit status $status"
} 2>&1 | tee -a "$log"

# Whatever happened, bring back what exists (at most 8 files of 16 MiB each come back). DRAFTER_BACK=0 leaves
# the weights on the machine for a call that a resumed one follows (whether bringing them back costs a call:
# docs/HISTORY.md, "Lab notes moved out of the code").
if [ "${DRAFTER_BACK:-1}" = 1 ]; then
  mkdir -p "$OUT/drafter"
  cp "$WORK"/train/drafter/* "$OUT/drafter/" 2>/dev/null || echo "no drafter exported yet" | tee -a "$log"
fi
cp "$WORK/train/train-log.jsonl" "$OUT/" 2>/dev/null
# the corpus's stats come back from the call that made them (one file fewer where a drafter fills the slots)
[ "$WORK/data-stats.json" -nt "$began_mark" ] && cp "$WORK/data-stats.json" "$OUT/"
# CORPUS_BACK=1: the data this call made, to be unpacked into the data folder of a later session's call
# (``tar -xJf`` in $WORK; training reads every shard there, top-ups included). A first call packs the folder's
# data, a top-up its newest more-K/ folder.
if [ "${CORPUS_BACK:-0}" = 1 ]; then
  newest=$(ls -d "$WORK"/more-* 2>/dev/null | sort -V | tail -n 1)
  if [ "${MORE_DATA_MIN:-0}" != 0 ] && [ -n "$newest" ]; then
    name="corpus-${SEED:-0}-$(basename "$newest")"; members=("$(basename "$newest")")
    cp "$newest/data-stats.json" "$OUT/more-stats.json" 2>/dev/null
  else
    name="corpus-${SEED:-0}"
    members=($(cd "$WORK" && ls -d prompts.jsonl heldout.jsonl data-stats.json responses-*.pt part-* 2>/dev/null))
  fi
  tar -C "$WORK" -cf - "${members[@]}" | xz -T0 -6 | split -b 15M -d -a 1 - "$OUT/$name.tar.xz.part-"
  parts=$(ls "$OUT/$name".tar.xz.part-* | wc -l)
  [ "$parts" -le 4 ] || say "the corpus needs $parts parts of 15 MiB: only 4 come back beside the logs; make less"
fi
ls -lR "$OUT" | tee -a "$log"
cp "$log" "$OUT/run.log"
exit "$(cat "$WORK/status" 2>/dev/null || echo 1)"
