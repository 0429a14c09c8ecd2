#!/usr/bin/env bash
# The serving benchmark on the device H200, through the real HTTP server.
#
#   gpu/serving.sh base          # from the repo root on the device; results under $OUT/server
#
# Starts `zerod serve --load-format dummy --dtype bfloat16` on a config-only
# Llama-3-8B-shaped directory (gpu/server_make_model.py: config.json + the demo tokenizer),
# waits for /health, runs the `zerod bench` scenarios, scrapes /metrics, sends SIGTERM
# (the server must drain and exit 0) and prints a table against docs/perf.md's targets last.
# Needs only python3 with torch, aiohttp, click, prometheus-client, tokenizers, jinja2,
# safetensors (no psutil / openai: bench reads /proc itself).
#
# Knobs (environment):
#   SHAPE=8b|tiny  DEVICE=cuda|cpu  PORT=8000  READY_TIMEOUT=200 (the whole script stays under
#   ~10 min: ready <= 200 s, bench <= 330 s, drain <= 20 s)
#   SERVE_ARGS   extra/overriding `zerod serve` flags
#   SCENARIOS    default: hello-ttft streams-200 decode-b1 prefill-16k long-context
#   BENCH_ARGS   extra `zerod bench` flags (e.g. smaller shapes for a CPU smoke run:
#                SHAPE=tiny DEVICE=cpu SERVE_ARGS="--dtype float32 --max-model-len 2048"
#                BENCH_ARGS="--num-prompts 4 --input-len 64 --short-input-len 16 --output-len 16 --max-concurrency 4 --warmup 1")
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/zerod-out}
R="$OUT/server"
mkdir -p "$R"
SHAPE=${SHAPE:-8b}
DEVICE=${DEVICE:-cuda}
PORT=${PORT:-8000}
READY_TIMEOUT=${READY_TIMEOUT:-200}
MODEL_DIR=${MODEL_DIR:-/tmp/zerod-dummy-$SHAPE}
SCENARIOS=${SCENARIOS:-hello-ttft streams-200 decode-b1 prefill-16k long-context}
SERVE_ARGS=${SERVE_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) uncommitted paths"
  echo "shape: $SHAPE device: $DEVICE"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null
  $PY -c 'import sys, torch, aiohttp; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "aiohttp", aiohttp.__version__)'
} > "$R/env.txt" 2>&1

$PY gpu/server_make_model.py "$MODEL_DIR" --shape "$SHAPE" || { echo "FAILED: model dir"; exit 1; }

T0=$(date +%s.%N)
# shellcheck disable=SC2086
$PY -m zerod serve --model "$MODEL_DIR" --load-format dummy --dtype bfloat16 \
    --device "$DEVICE" --port "$PORT" --max-model-len 17408 --max-num-seqs 256 \
    --gpu-memory-utilization 0.90 --drain-timeout 20 $SERVE_ARGS > "$R/serve.log" 2>&1 &
SPID=$!

READY=$($PY gpu/wait_health.py "$PORT" "$READY_TIMEOUT" "$SPID")
T1=$(date +%s.%N)
READY_S=$($PY -c "print(round($T1 - $T0, 1))")
echo "ready: $READY after ${READY_S}s (process start to /health 200, incl. python + torch import)" | tee -a "$R/env.txt"
if [ "$READY" != "ok" ]; then
  echo "FAILED: the server did not become healthy ($READY); last log lines:"
  tail -30 "$R/serve.log"
  kill -9 "$SPID" 2>/dev/null
  exit 1
fi

SC=""
for s in $SCENARIOS; do SC="$SC --scenario $s"; done
# shellcheck disable=SC2086
timeout 330 $PY -m zerod bench --port "$PORT" --server-pid "$SPID" --out "$R/bench.json" \
    $SC $BENCH_ARGS > "$R/bench.log" 2>&1
BENCH_RC=$?

$PY -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=10).read().decode())" \
    > "$R/metrics.txt" 2>&1

kill -TERM "$SPID"
TS=$(date +%s.%N)
wait "$SPID"
SERVE_RC=$?
STOP_S=$($PY -c "print(round($(date +%s.%N) - $TS, 1))")
echo "bench rc: $BENCH_RC; serve exit after SIGTERM: $SERVE_RC in ${STOP_S}s" | tee -a "$R/env.txt"

$PY gpu/server_summary.py "$R/bench.json" "$READY_S" "$SERVE_RC" > "$R/summary.txt" 2>&1
tail -5 "$R/serve.log"
echo "---- bench output (last lines)"
tail -12 "$R/bench.log"
echo "---- summary (results in $R)"
cat "$R/summary.txt"
