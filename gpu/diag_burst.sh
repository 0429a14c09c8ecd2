#!/usr/bin/env bash
# A/B on one machine: the 200-stream burst (first after start, then warmed) and a short
# mixed-traffic run, for the code before this round (.old: `git archive 708684d`) and this
# tree with its scheduler options. Results: $OUT/diag.tgz; a table last.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-diag}; mkdir -p "$FINAL"
W=/tmp/diag; rm -rf "$W"; mkdir -p "$W"
ROOT=$PWD
. gpu/wheels.sh psutil   # packages the device image lacks, carried in .whl
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
variant() {  # NAME DIR EXTRA_SERVE_ARGS
  local name=$1 dir=$2; shift 2
  echo "== $(date -u +%T) $name" | tee -a "$W/timeline.txt"
  (cd "$dir" && exec $PY -m zerod serve --model "$M" --load-format dummy --dtype bfloat16 --port 8000 \
      --max-model-len 17408 --max-num-seqs 256 --gpu-memory-utilization 0.90 "$@") > "$W/$name.serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 480); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break; sleep 0.25; done
  B="$PY -m zerod bench --port 8000 --no-progress"
  timeout 40 $B --scenario streams-200 --warmup 0 --out "$W/$name.first.json" > /dev/null 2>&1
  timeout 40 $B --scenario streams-200 --out "$W/$name.s200.json" > /dev/null 2>&1
  timeout 40 $B --scenario mix --num-prompts 300 --out "$W/$name.mix.json" > /dev/null 2>&1
  kill -TERM $pid; wait $pid
  tar czf "$FINAL/diag.tgz" -C "$W" .
}
variant old "$ROOT/.old"
variant head "$ROOT"
variant head-nocache "$ROOT" --no-enable-prefix-caching
variant head-fixed "$ROOT" --min-prefill-chunk 2048 --target-itl-ms 100000
$PY - "$W" <<'PYEOF'
import json, sys, os
W = sys.argv[1]
def g(f, s, *k):
    try:
        d = json.load(open(os.path.join(W, f)))["scenarios"][s]
        for x in k: d = d[x]
        return d
    except Exception: return None
print(f"{'variant':14} {'1st tok/s':>9} {'1st TTFT p50/p99':>17} {'s200 tok/s':>10} {'s200 TTFT p50/p99':>18} {'s200 ITLmax':>11} {'mix TTFT p50/p99':>17} {'mix ITL p99':>11}")
for v in ("old", "head", "head-nocache", "head-fixed"):
    f = lambda x: "-" if x is None else f"{x:,.0f}"
    print(f"{v:14} {f(g(v+'.first.json','streams-200','output_throughput')):>9} "
          f"{f(g(v+'.first.json','streams-200','ttft_ms','p50'))+'/'+f(g(v+'.first.json','streams-200','ttft_ms','p99')):>17} "
          f"{f(g(v+'.s200.json','streams-200','output_throughput')):>10} "
          f"{f(g(v+'.s200.json','streams-200','ttft_ms','p50'))+'/'+f(g(v+'.s200.json','streams-200','ttft_ms','p99')):>18} "
          f"{f(g(v+'.s200.json','streams-200','itl_ms','max')):>11} "
          f"{f(g(v+'.mix.json','mix','ttft_ms','p50'))+'/'+f(g(v+'.mix.json','mix','ttft_ms','p99')):>17} "
          f"{f(g(v+'.mix.json','mix','itl_ms','p99')):>11}")
PYEOF
grep -h "took" "$W"/*.serve.log | head -30
