#!/usr/bin/env bash
# What does tensor parallelism over two H200s give? On the 2-GPU machine (nvidia-h200-x2), through the HTTP server.
#
#   bash gpu/tp.sh         # from the repo root on the device; results under $OUT/tp
#   SMOKE=1 bash gpu/tp.sh # a CPU machine: tiny shapes, gloo, proves it end to end
#
# Phases (each timed, a table last):
#   1. the GPU tests of tensor parallelism (tests/test_engine_tp.py -m gpu; need 2 GPUs)
#   2. the all-reduce per layer at the decode hidden size (gpu/tp_allreduce.py, through
#      engine/tp/parallel.py's group): eager and inside a CUDA graph, vs the link's ~400 GB/s
#   3. Llama-3-8B shape, dummy bf16: batch-1 decode at TP=1, then TP=2 (the ratio)
#   4. Llama-3-70B shape, dummy bf16, TP=2: batch-1 decode, 200 streams (24 in / 128 out)
#      throughput and TTFT p50/p99; ready time (dummy init + graph capture) printed
# Every server is stopped by SIGTERM and must exit 0 with no worker left behind.
# Budget: well under 9 minutes on the x2 machine (ready <= 240 s each for 70B).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
. gpu/parts/wheels.sh psutil   # packages the device image lacks (psutil, xgrammar, ...), carried in .whl
OUT=${OUT:-/tmp/zerod-out}
R="$OUT/tp"
mkdir -p "$R"
SMOKE=${SMOKE:-0}
PORT=${PORT:-8010}
if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu; BIG=tiny; SMALL=tiny; READY_TIMEOUT=120
  SERVE_ARGS="--dtype float32 --max-model-len 512 --kv-pages 200 --max-num-seqs 16"
  B1_ARGS="--output-len 8 --num-prompts 2 --warmup 1"
  S200_ARGS="--num-prompts 8 --max-concurrency 8 --output-len 8 --warmup 1"
  AR_ARGS="--device cpu --hidden 256 --iters 20 --big-mib 4"
else
  DEVICE=cuda; BIG=70b; SMALL=8b; READY_TIMEOUT=${READY_TIMEOUT:-240}
  SERVE_ARGS="--dtype bfloat16 --max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.92"
  B1_ARGS=""; S200_ARGS=""; AR_ARGS=""
fi
SUMMARY="$R/summary.txt"
: > "$SUMMARY"

phase() { echo "== $1 ($(date -u +%T))"; PHASE_T0=$(date +%s.%N); }
took() { $PY -c "print(round($(date +%s.%N) - $PHASE_T0, 1))"; }

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) uncommitted paths"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  nvidia-smi topo -m 2>/dev/null | head -4
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

# ---------------------------------------------------------------- 1. GPU tests
phase "GPU tests of tensor parallelism"
if [ "$DEVICE" = cuda ]; then
  timeout 240 $PY -m pytest tests/test_engine_tp.py -m gpu -q -p no:randomly > "$R/gpu-tests.txt" 2>&1
  echo "gpu tests: $(tail -1 "$R/gpu-tests.txt") ($(took) s)" | tee -a "$SUMMARY"
else
  echo "gpu tests: skipped (SMOKE: no GPU)" | tee -a "$SUMMARY"
fi

# ---------------------------------------------------------------- 2. all-reduce
phase "all-reduce per layer"
# shellcheck disable=SC2086
timeout 120 $PY gpu/tp_allreduce.py "$R/allreduce.json" $AR_ARGS > "$R/allreduce.txt" 2>&1
cat "$R/allreduce.txt"
echo "all-reduce phase: $(took) s" >> "$SUMMARY"

# ---------------------------------------------------------------- servers
serve() {  # serve NAME SHAPE TP: start, wait for /health, leave SPID and READY_S
  local name=$1 shape=$2 tp=$3 dir=/tmp/zerod-dummy-$2
  $PY gpu/server_make_model.py "$dir" --shape "$shape" > /dev/null || return 1
  local t0; t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  $PY -m zerod serve --model "$dir" --load-format dummy --device "$DEVICE" --port "$PORT" \
      --tensor-parallel-size "$tp" --drain-timeout 20 $SERVE_ARGS > "$R/$name.serve.log" 2>&1 &
  SPID=$!
  local ok
  ok=$($PY gpu/wait_health.py "$PORT" "$READY_TIMEOUT" "$SPID")
  READY_S=$($PY -c "print(round($(date +%s.%N) - $t0, 1))")
  if [ "$ok" != ok ]; then
    echo "FAILED: $name not healthy ($ok) after ${READY_S}s"; tail -20 "$R/$name.serve.log"
    kill -9 "$SPID" 2>/dev/null; pkill -9 -P "$SPID" 2>/dev/null; return 1
  fi
  echo "$name ready in ${READY_S}s (dummy init + graph capture)" | tee -a "$SUMMARY"
  grep -E "captured|KV pages|engine ready" "$R/$name.serve.log" | tail -3
}

stop() {  # stop NAME: SIGTERM, exit status, no worker left
  local name=$1 kids
  kids=$(pgrep -P "$SPID" | tr '\n' ' ')
  kill -TERM "$SPID"; wait "$SPID"; local rc=$?
  sleep 1
  local left=""
  for k in $kids; do [ -e "/proc/$k" ] && left="$left $k"; done
  echo "$name: SIGTERM exit $rc, workers [$kids] left [${left# }]" | tee -a "$SUMMARY"
}

bench() {  # bench NAME SCENARIO ARGS...
  local name=$1 sc=$2; shift 2
  timeout 200 $PY -m zerod bench --port "$PORT" --server-pid "$SPID" --scenario "$sc" \
      --out "$R/$name.json" "$@" > "$R/$name.txt" 2>&1
  tail -4 "$R/$name.txt"
}

# ---------------------------------------------------------------- 3. 8B TP=1 vs TP=2
for tp in 1 2; do
  phase "$SMALL TP=$tp batch-1 decode"
  if serve "$SMALL-tp$tp" "$SMALL" "$tp"; then
    # shellcheck disable=SC2086
    bench "$SMALL-tp$tp-b1" decode-b1 $B1_ARGS
    stop "$SMALL-tp$tp"
  fi
done

# ---------------------------------------------------------------- 4. 70B TP=2
phase "$BIG TP=2"
if serve "$BIG-tp2" "$BIG" 2; then
  # shellcheck disable=SC2086
  bench "$BIG-tp2-b1" decode-b1 $B1_ARGS
  # shellcheck disable=SC2086
  bench "$BIG-tp2-s200" streams-200 $S200_ARGS
  $PY -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=10).read().decode())" \
      > "$R/$BIG-tp2.metrics.txt" 2>&1
  stop "$BIG-tp2"
fi

echo "---- summary (results in $R)"
$PY gpu/tp_summary.py "$R" "$SMALL" "$BIG" | tee -a "$SUMMARY"
