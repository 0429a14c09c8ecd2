#!/usr/bin/env bash
# Round 2 serving evidence on the device H200, in one call (<= 10 min):
#   1. the first 200-stream burst after start (no warm-up), then run A's scenarios
#      (hello-ttft streams-200 decode-b1 prefill-16k long-context): the reshape must keep
#      them within 3 % of docs/perf.md run A;
#   2. mixed Poisson traffic at 25 and 10 req/s and shared prefixes, with goodput;
#   3. 200 streams again with a 128K-entry tokenizer whose every id decodes to text (the
#      poller's real cost): carried in .models/bigtok (python3 gpu/big_tokenizer.py .models/bigtok);
#   4. zerod doctor --save-facts (the new checks' H200 snapshot).
# Everything lands in $OUT/round2.tgz; the table of gpu/round2_summary.py prints last.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-round2}; mkdir -p "$FINAL"
W=/tmp/r2; rm -rf "$W"; mkdir -p "$W"
. gpu/wheels.sh psutil   # packages the device image lacks, carried in .whl
pack() { tar czf "$FINAL/round2.tgz" -C "$W" . 2>/dev/null; }
stamp() { echo "== $(date -u +%T) $*" | tee -a "$W/timeline.txt"; }
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch, tokenizers, aiohttp; print("torch", torch.__version__, "tokenizers", tokenizers.__version__, "aiohttp", aiohttp.__version__)'; } > "$W/env.txt" 2>&1

# SMOKE=1: the same steps on the CPU with a tiny shape and small loads (checks the script)
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 17408 --max-num-seqs 256"; SMALL=""
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 2048 --max-num-seqs 16"
  SMALL="--num-prompts 4 --input-len 32 --short-input-len 16 --output-len 4 --warmup 1 --max-concurrency 4
         --input-len-range 8:64 --output-len-range 2:8 --prefix-len 32 --num-prefixes 2 --suffix-len 4"
fi
M8=/tmp/zerod-dummy-$SHAPE
MBIG=/tmp/zerod-dummy-$SHAPE-bigtok
$PY gpu/server_make_model.py "$M8" --shape $SHAPE > /dev/null || exit 1
$PY gpu/server_make_model.py "$MBIG" --shape $SHAPE > /dev/null || exit 1
cp .models/bigtok/tokenizer.json .models/bigtok/tokenizer_config.json "$MBIG"/ || exit 1
$PY - "$MBIG" <<'PYEOF'
import json, sys
d = sys.argv[1]
c = json.load(open(f"{d}/config.json"))
c["bos_token_id"], c["eos_token_id"] = 128254, 128255   # the big tokenizer's specials
c["vocab_size"] = max(c["vocab_size"], 128256)
json.dump(c, open(f"{d}/config.json", "w"), indent=1)
PYEOF

serve() {  # serve MODEL_DIR LOG [CODE_DIR]: start zerod serve, wait for /health
  # shellcheck disable=SC2086
  (cd "${3:-.}" && exec $PY -m zerod serve --model "$1" --load-format dummy --port 8000 $SERVE_X \
      --gpu-memory-utilization 0.90 --drain-timeout 20) > "$2" 2>&1 &
  SPID=$!
  T0=$(date +%s.%N)
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null http://127.0.0.1:8000/health && break
    kill -0 $SPID 2>/dev/null || { echo "serve died"; tail -20 "$2"; return 1; }
    sleep 0.25
  done
  echo "ready after $($PY -c "print(round($(date +%s.%N) - $T0, 1))") s" | tee -a "$W/timeline.txt"
}
stop() { kill -TERM $SPID; wait $SPID; echo "serve exit $?" | tee -a "$W/timeline.txt"; }
B="$PY -m zerod bench --port 8000 --no-progress $SMALL"

stamp "1 server (demo tokenizer)"
serve "$M8" "$W/serve.log" || { pack; exit 1; }
stamp "first burst: 200 streams, no warm-up"
timeout 60 $B --scenario streams-200 --warmup 0 --out "$W/first-burst.json" > "$W/first-burst.txt" 2>&1
stamp "run A scenarios"
timeout 240 $B --scenario hello-ttft --scenario streams-200 --scenario decode-b1 --scenario prefill-16k \
    --scenario long-context --out "$W/runA.json" > "$W/runA.txt" 2>&1
pack
stamp "mix 25 req/s"
timeout 90 $B --scenario mix --goodput ttft:400 --goodput itl:60 --out "$W/mix25.json" > "$W/mix25.txt" 2>&1
stamp "mix 10 req/s"
timeout 90 $B --scenario mix --request-rate 10 --num-prompts 240 --goodput ttft:400 --goodput itl:25 \
    --out "$W/mix10.json" > "$W/mix10.txt" 2>&1
stamp "prefix"
timeout 90 $B --scenario prefix --goodput ttft:80 --out "$W/prefix.json" > "$W/prefix.txt" 2>&1
curl -s http://127.0.0.1:8000/metrics > "$W/metrics.txt"
stop; pack

stamp "2 server (128K tokenizer)"
serve "$MBIG" "$W/serve-bigtok.log" || { pack; exit 1; }
timeout 90 $B --scenario streams-200 --out "$W/bigtok.json" > "$W/bigtok.txt" 2>&1
stop; pack

if [ "${FIXED:-1}" = 1 ]; then   # this tree with the fixed chunk budget of before: the scheduler's share
  stamp "2a this tree, fixed 2048-token chunk budget"
  SAVED_X=$SERVE_X; SERVE_X="$SERVE_X --min-prefill-chunk 2048 --target-itl-ms 100000"
  serve "$M8" "$W/serve-fixed.log" || { pack; exit 1; }
  SERVE_X=$SAVED_X
  timeout 60 $B --scenario streams-200 --warmup 0 --out "$W/fixed-first-burst.json" > "$W/fixed-first-burst.txt" 2>&1
  timeout 60 $B --scenario streams-200 --out "$W/fixed-s200.json" > "$W/fixed-s200.txt" 2>&1
  stop; pack
fi

if [ -d .old ]; then   # the code before this round, same machine, same client: run A's scenarios
  stamp "2b the code before this round (.old)"
  serve "$M8" "$W/serve-old.log" .old || { pack; exit 1; }
  timeout 60 $B --scenario streams-200 --warmup 0 --out "$W/old-first-burst.json" > "$W/old-first-burst.txt" 2>&1
  timeout 240 $B --scenario hello-ttft --scenario streams-200 --scenario decode-b1 --scenario prefill-16k \
      --scenario long-context --out "$W/old-runA.json" > "$W/old-runA.txt" 2>&1
  timeout 90 $B --scenario mix --goodput ttft:400 --goodput itl:60 --out "$W/old-mix25.json" > "$W/old-mix25.txt" 2>&1
  stop; pack
fi

stamp "3 doctor"
$PY -m zerod doctor --json --save-facts "$W/h200-facts.json" > "$W/doctor.json" 2> "$W/doctor.err"
echo "doctor exit $?" | tee -a "$W/timeline.txt"
stamp "done"; pack
$PY gpu/round2_summary.py "$W" | tee "$W/summary.txt"
pack
