#!/usr/bin/env bash
# The engine's decode step on a GPU under the changes the fifth GPU run pointed at (benchmark/README.md, "Where the
# engine's step goes"), each in a process of its own under one deadline, OPT-1.3b float16 by default: as built
# (the engine's default steps a call), each call sent before the one in flight is read (Engine(ahead=True): the
# host's turn between calls beside the card's work), more steps a call (that turn spread over more steps),
# XLA's command buffers over whole loops and conditionals (a call's steps one CUDA graph, not one a step), and
# cuBLAS for every product instead of XLA's Triton fusions (at batch 1 those read the weights at about two thirds
# of the copy bandwidth). generate() is timed beside the first; the first two are also profiled (a
# JAX trace a batch, copied into OUT and split by trace_split.py into the card's busy time and its gaps). Prints
# the report of all of them last.
#
#   bash benchmark/gpu/engine_variants.sh                        on a GPU machine, with its own python3
#   REHEARSAL=1 bash benchmark/gpu/engine_variants.sh            the same on a CPU, tiny model
#
# Settings (environment): BUDGET_S (default 540), SIZE (1.3b), STEPS (16: the second variant's steps a call),
# ARGS (passed to every variant), PYTHON, OUT (default /tmp/engine_variants).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/engine_variants}
mkdir -p "$OUT"
RESULTS=$OUT/variants.jsonl
: > "$RESULTS"
# one compile cache for all of them, outside OUT: the variants that share XLA's flags reuse the programs compiled
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export OPT_SERVING_COMPILE_CACHE=${OPT_SERVING_COMPILE_CACHE:-/tmp/engine_variants_cache}
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
if [ -n "${REHEARSAL:-}" ]; then
  SIZE=${SIZE:-tiny}
  ARGS=${ARGS:---batches 1,4 --new-tokens 8 --prompt-len 8 --logit-len 8 --max-seq-len 64 --copy-mib 16}
else
  SIZE=${SIZE:-1.3b}
  ARGS=${ARGS:---batches 1,64}
fi
GRAPHS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"

variant() {  # variant NAME PARTS [ENV=VALUE...] -- [MODEL ARGS...]: one process, its share of what is left
  local name=$1 parts=$2; shift 2
  local envs=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift
  local now left; now=$(date +%s); left=$(( deadline - now ))
  if [ "$left" -lt 30 ]; then
    echo "{\"section\": \"model\", \"check\": \"stopped\", \"what\": \"variant $name skipped: ${left}s left\"}" >> "$RESULTS"
    return
  fi
  local until=$(( now + left / ${SHARES:-1} ))
  echo "== $name ($(( until - now ))s of ${left}s left)"
  # shellcheck disable=SC2086
  env "${envs[@]}" timeout --kill-after=10 "$(( until - now + 15 ))" "$PY" benchmark/gpu/gpu_check.py model \
    --size "$SIZE" --dtype float16 $ARGS --ttft-batch 0 --parts "$parts" --variant "$name" "$@" --out "$RESULTS" \
    --deadline "$until" 2>&1 | grep -v '^  {' | tail -5
}

TRACES=$OUT/traces  # the first two variants profiled at each batch (one more run under JAX's profiler)
# (the first a quarter of the time, as it times generate() too; the others share the rest)
SHARES=4 variant as-built engine,generate -- --profile "$TRACES/as-built"
SHARES=4 variant ahead engine -- --engine-ahead --profile "$TRACES/ahead"
SHARES=3 variant "steps-${STEPS:-16}" engine -- --engine-steps "${STEPS:-16}"
SHARES=2 variant loop-graphs engine "XLA_FLAGS=${XLA_FLAGS:-} $GRAPHS"
SHARES=1 variant cublas engine "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false"
"$PY" benchmark/gpu/gpu_check.py report --out "$RESULTS"
# each trace beside the results (what comes back from a lent machine is at most two folders down), and its split
for f in "$TRACES"/*/*/plugins/profile/*/perfetto_trace.json.gz; do
  [ -e "$f" ] || continue
  name=$(echo "$f" | awk -F/ '{print $(NF-5) "-" $(NF-4)}')
  cp "$f" "$OUT/$name.json.gz"
  echo "== $name: $("$PY" benchmark/gpu/trace_split.py "$OUT/$name.json.gz" --top 3 | head -1)"
done
