#!/usr/bin/env bash
# The prepared GPU check (benchmark/gpu/gpu_check.py): correctness against Hugging Face torch on tiny models, then
# OPT-1.3b and OPT-6.7b random weights in float16 and bfloat16 (logits, the card's copy bandwidth, tokens/s of our
# engine and our generate() at batch 1 / 16 / 64 with each decode step's time against the bytes it reads, TTFT of
# 64 prompts of 512 tokens arriving together, HF generate(), memory against the planner), then HF under
# torch.compile; one process a section, all under one deadline, most important first. Prints the report last.
#
#   bash benchmark/gpu_check.sh                   on a GPU machine, with that machine's own python3
#   GPU_CHECK_REHEARSAL=1 bash benchmark/gpu_check.sh    the same script on a CPU: small sizes, few tokens
#
# Needs JAX (with its CUDA plugin on a GPU), Flax, torch and transformers; not Ray, FastAPI or our C extensions.
# Settings (environment): GPU_CHECK_BUDGET_S (default 450), GPU_CHECK_SIZES, GPU_CHECK_DTYPES, GPU_CHECK_ARGS
# (passed to every model section), GPU_CHECK_MODEL_CAP_S (default 100: the most one model section may take),
# GPU_CHECK_TINY_CAP_S (default 90; 0: no tiny section), GPU_CHECK_WEIGHTS (default "float": each size's weights in its dtype;
# "float int8" adds int8 weights beside activations in that dtype), GPU_CHECK_COMPILE (default 1; 0: no HF
# torch.compile section), PYTHON, OUT (results folder; default /tmp/gpu_check).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
RESULTS=$OUT/gpu_check.jsonl
: > "$RESULTS"
export PYTHONUNBUFFERED=1
# torch and JAX share the card in one process: JAX takes memory as it needs it, not 75% of the card at start
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export OPT_SERVING_COMPILE_CACHE=0   # first compiles are part of what this measures
deadline=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-450} ))

if [ -n "${GPU_CHECK_REHEARSAL:-}" ]; then
  SIZES=${GPU_CHECK_SIZES:-tiny 125m}
  DTYPES=${GPU_CHECK_DTYPES:-float16 bfloat16}
  ARGS=${GPU_CHECK_ARGS:---batches 1,4,8 --new-tokens 8 --prompt-len 8 --logit-len 16 --max-seq-len 64 --ttft-batch 8 --ttft-prompt-len 40 --copy-mib 64}
  ENV_ARGS="--copy-mib 64"
else
  SIZES=${GPU_CHECK_SIZES:-1.3b 6.7b}
  DTYPES=${GPU_CHECK_DTYPES:-float16 bfloat16}
  ARGS=${GPU_CHECK_ARGS:-}
  ENV_ARGS=""
fi

section() {  # section CAP NAME [ARGS...]: run it until CAP seconds from now or the deadline, whichever is first
  local cap=$1; shift
  local now; now=$(date +%s)
  local left=$(( deadline - now ))
  if [ "$left" -lt 20 ]; then
    echo "== $*: skipped, ${left}s left"
    echo "{\"section\": \"$1\", \"check\": \"stopped\", \"what\": \"$* skipped: ${left}s left\"}" >> "$RESULTS"
    return
  fi
  local until=$(( now + cap < deadline ? now + cap : deadline ))
  echo "== $* ($(( until - now ))s of ${left}s left)"
  timeout --kill-after=10 "$(( until - now + 15 ))" "$PY" benchmark/gpu/gpu_check.py "$@" --out "$RESULTS" \
    --deadline "$until" > >(tee -a "$OUT/gpu_check.log") 2>&1
  local rc=$?
  echo "== $1 finished rc=$rc in $(( $(date +%s) - now ))s"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ]; then
    echo "{\"section\": \"$1\", \"check\": \"stopped\", \"what\": \"$* exited $rc (see gpu_check.log)\"}" >> "$RESULTS"
  fi
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# each model section gets at most its share of what is left, so a slow one leaves the others their turn
MODEL_CAP=${GPU_CHECK_MODEL_CAP_S:-100}
# shellcheck disable=SC2086
section 60 env $ENV_ARGS
[ "${GPU_CHECK_TINY_CAP_S:-90}" = 0 ] || section "${GPU_CHECK_TINY_CAP_S:-90}" tiny
for dtype in $DTYPES; do
  for size in $SIZES; do
    for weights in ${GPU_CHECK_WEIGHTS:-float}; do
      quant=""
      [ "$weights" = float ] || quant="--quantize $weights"
      # shellcheck disable=SC2086
      section "$MODEL_CAP" model --size "$size" --dtype "$dtype" $quant $ARGS
    done
  done
done
first_size=${SIZES%% *}
first_dtype=${DTYPES%% *}
if [ "${GPU_CHECK_COMPILE:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  section "$MODEL_CAP" compile --size "$first_size" --dtype "$first_dtype" $ARGS
fi
"$PY" benchmark/gpu/gpu_check.py report --out "$RESULTS"
