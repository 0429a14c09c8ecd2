#!/usr/bin/env bash
# The mixed chat/agent traffic and the shared prefixes of docs/perf.md's targets on the H200
# (~3 min): the dummy Llama-3-8B server (bf16), `zerod bench --scenario mix` (Poisson 25 req/s,
# prompts 32-4096 and outputs 16-512 tokens, log-uniform), the same lengths at 10 req/s (240
# requests), then `--scenario prefix` (16 shared 2,000-token prefixes, 16 req/s).
# Results: $OUT/mix.tgz (bench JSON and text, the serve log, /metrics); the tables last.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-mix}; mkdir -p "$FINAL"
W=/tmp/mix; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh psutil
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
$PY -m zerod serve --model "$M" --load-format dummy --port 8000 --dtype bfloat16 --max-model-len 17408 \
    --max-num-seqs 256 > "$W/serve.log" 2>&1 &
SPID=$!
[ "$($PY gpu/wait_health.py 8000 150 $SPID)" = ok ] || { tail -20 "$W/serve.log"; kill $SPID; exit 1; }
B="$PY -m zerod bench --port 8000 --no-progress"
timeout 60 $B --scenario mix --goodput ttft:400 --goodput itl:60 --out "$W/mix25.json" > "$W/mix25.txt" 2>&1
timeout 45 $B --scenario mix --request-rate 10 --num-prompts 240 --goodput ttft:400 --goodput itl:25 --out "$W/mix10.json" > "$W/mix10.txt" 2>&1
timeout 90 $B --scenario prefix --goodput ttft:80 --out "$W/prefix.json" > "$W/prefix.txt" 2>&1
curl -s http://127.0.0.1:8000/metrics > "$W/metrics.txt"
kill -TERM $SPID; wait $SPID
tar czf "$FINAL/mix.tgz" -C "$W" .
cat "$W/mix25.txt" "$W/mix10.txt" "$W/prefix.txt"; grep -c "to launch" "$W/serve.log"
