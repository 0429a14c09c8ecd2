#!/usr/bin/env bash
# Fresh prompts' SDPA backend A/B on the standard 200-stream scenario (H200, ~3 min): the FP8
# 8B server (dummy weights) under gpu/step_stalls_serve.py's variants shipped (plan-free
# backends up to 1K tokens) and cudnn-every-length (the rule before), alternated, each
# server running streams-200 three times. Results: $OUT/sdpa_ab.tgz; a table last.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-sdpa-ab}; mkdir -p "$FINAL"
W=/tmp/sdpa_ab; rm -rf "$W"; mkdir -p "$W"
. gpu/wheels.sh psutil
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
for V in shipped cudnn-every-length shipped cudnn-every-length; do
  $PY gpu/step_stalls_serve.py $V serve --model "$M" --load-format dummy --port 8000 --dtype bfloat16 \
      --max-model-len 17408 --max-num-seqs 256 --gpu-memory-utilization 0.90 --quantization fp8 \
      > "$W/serve-$V.log" 2>&1 &
  SPID=$!
  [ "$($PY gpu/wait_health.py 8000 150 $SPID)" = ok ] || { tail -20 "$W/serve-$V.log"; kill $SPID; continue; }
  for i in 1 2 3; do
    timeout 60 $PY -m zerod bench --port 8000 --no-progress --scenario streams-200 \
        --out "$W/$V-$i-$RANDOM.json" > /dev/null 2>&1
  done
  kill -TERM $SPID; wait $SPID
  tar czf "$FINAL/sdpa_ab.tgz" -C "$W" .
done
$PY - "$W" <<'PYEOF'
import glob, json, os, statistics, sys
print(f"{'variant':20s} {'runs':>4s} {'tok/s med':>10s} {'TTFT p50 med':>13s} {'TTFT p99 med':>13s}  all tok/s")
for v in ("shipped", "cudnn-every-length"):
    rs = [next(iter(json.load(open(f))["scenarios"].values())) for f in sorted(glob.glob(os.path.join(sys.argv[1], v + "-*.json")))]
    if not rs:
        print(f"{v:20s}    0"); continue
    tp = [r["output_throughput"] for r in rs]
    print(f"{v:20s} {len(rs):4d} {statistics.median(tp):10,.0f} {statistics.median(r['ttft_ms']['p50'] for r in rs):13.1f} "
          f"{statistics.median(r['ttft_ms']['p99'] for r in rs):13.1f}  {[round(t) for t in tp]}")
PYEOF
