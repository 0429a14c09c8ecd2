#!/usr/bin/env bash
# bash gpu/serving.sh stalls: the "no stall" figures on the H200 (docs/perf.md, "Step stalls"): the Llama-3-8B shape
# (dummy bf16 weights), one fresh server per variant, gpu/stalls_probe.py from READY on.
# Variants (VARIANTS, default "before after"): "before" is the tree in .before/ (git archive
# of the reference commit, carried), "after" this tree, "tuned" this tree with
# ZEROD_TUNING=$TUNED (e.g. TUNED='{"one_forward_mixed_steps": true, "prefill_graph_seqs": 288}');
# each starts with its own empty Triton cache (cold), then "after" is restarted on its warm
# cache (RESTART=0 skips it). ~7 min for two variants. Results: $OUT/stalls-*.json, the serve
# logs, each server's step trace (steps-*.jsonl.gz: `gpu/schedule_sim.py --fit` reads it
# unpacked; the code in .before/ may not write one), a table.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUTD=${OUT:-/tmp/zerod-stalls}; mkdir -p "$OUTD"
. gpu/parts/wheels.sh xgrammar
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
ROOT=$PWD
VARIANTS=${VARIANTS:-before after}
serve() {   # serve DIR NAME CACHE [TUNING]: start, wait for /health, print the seconds to READY
    local dir=$1 name=$2
    ( cd "$dir" && TRITON_CACHE_DIR=$3 ZEROD_TUNING=${4:-} ZEROD_STEP_TRACE=$OUTD/steps-$name.jsonl exec $PY -m zerod serve --model "$M" --load-format dummy --port 8000 \
        --dtype bfloat16 --max-model-len 17408 --max-num-seqs 256 ) > "$OUTD/serve-$name.log" 2>&1 &
    SPID=$!
    local t0=$(date +%s.%N)
    [ "$($PY gpu/wait_health.py 8000 240 $SPID)" = ok ] || { tail -20 "$OUTD/serve-$name.log"; kill $SPID; return 1; }
    echo "$name ready_s $(awk "BEGIN{print $(date +%s.%N) - $t0}")" | tee -a "$OUTD/ready.txt"
}
stop() { kill -TERM $SPID; wait $SPID 2>/dev/null; }
for v in $VARIANTS; do
    dir=$ROOT; [ $v = before ] && dir=$ROOT/.before
    tuning=""; [ $v = tuned ] && tuning=${TUNED:?set TUNED to the ZEROD_TUNING JSON of the tuned variant}
    serve "$dir" $v /tmp/triton-$v "$tuning" || continue
    timeout 300 $PY gpu/stalls_probe.py 8000 "$OUTD/stalls-$v.json" ${PHASES:+--phases $PHASES}
    echo "$v slow-launch log lines: $(grep -c 'to launch' "$OUTD/serve-$v.log")" | tee -a "$OUTD/ready.txt"
    stop
done
if [ "${RESTART:-1}" = 1 ] && [[ " $VARIANTS " == *" after "* ]]; then
    serve "$ROOT" after-restart /tmp/triton-after && timeout 60 $PY gpu/stalls_probe.py 8000 "$OUTD/stalls-after-restart.json" --phases first16k,hello
    stop
fi
gzip -f "$OUTD"/serve-*.log "$OUTD"/steps-*.jsonl 2>/dev/null
$PY - "$OUTD" $VARIANTS <<'PYEOF'
import json, sys, os
d, variants = sys.argv[1], sys.argv[2:]
def load(v):
    p = os.path.join(d, f"stalls-{v}.json")
    return json.load(open(p)) if os.path.exists(p) else {}
runs = {v: load(v) for v in variants}
def g(r, *k):
    for x in k:
        r = (r or {}).get(x) if isinstance(r, dict) else None
    return r
def f(x):
    return "-" if x is None else (f"{x:.0f}" if isinstance(x, (int, float)) else ", ".join(f"{y:.0f}" for y in x))
rows = [("first 16K prompts TTFT ms", ("first16k", "ttft_ms")),
        ("32 streams + 16K: longest gap ms", ("streams16k", "streams_max_gap_ms")),
        ("32 streams + 16K: the prompt's TTFT ms", ("streams16k", "prompt_ttft_ms")),
        ("mix 25: ITL p99 ms", ("mix25", "itl_p99")), ("mix 25: TTFT p99 ms", ("mix25", "ttft_p99")),
        ("mix 25: max ITL ms", ("mix25", "itl_max")), ("mix 25: gaps > 100 ms", ("mix25", "gaps_over_100ms")),
        ("mix 10: TTFT p99 ms", ("mix10", "ttft_p99")), ("mix 10: ITL p99 ms", ("mix10", "itl_p99")),
        ("prefix, first run: TTFT p99 ms", ("prefix", "first", "ttft_p99")),
        ("prefix, second run: TTFT p99 ms", ("prefix", "second", "ttft_p99")),
        ("hello TTFT p50 ms", ("hello", "ttft_p50")),
        ("200 streams, first wave: TTFT p99 ms", ("burst200", "first", "ttft_p99")),
        ("200 streams, second wave: TTFT p99 ms", ("burst200", "second", "ttft_p99")),
        ("200 streams, second wave: output tokens/s", ("burst200", "second", "output_tokens_per_s"))]
print("| figure | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
for name, k in rows:
    print(f"| {name} | " + " | ".join(f(g(runs[v], *k)) for v in variants) + " |")
for v in variants:
    print(f"slow steps ({v}, cumulative at the end of mix25):", g(runs[v], "mix25", "slow_steps_after"))
print(open(os.path.join(d, "ready.txt")).read())
PYEOF
