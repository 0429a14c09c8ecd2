#!/usr/bin/env bash
# bash gpu/serving.sh stalls: the "no stall" figures on the H200 (docs/perf.md, "Step stalls"): the Llama-3-8B shape
# (dummy bf16 weights), one fresh server per variant, gpu/stalls_probe.py from READY on.
# Variants (VARIANTS, default "before after"): "before" is the tree in .before/ (git archive
# of the reference commit, carried), "after" this tree; any other NAME is this tree with
# ZEROD_TUNING=$TUNING_NAME and the extra serve flags $ARGS_NAME, e.g.
#   VARIANTS="after of of40" TUNING_of='{"one_forward_mixed_steps": true, "prefill_graph_seqs": 288}'
#   TUNING_of40=$TUNING_of ARGS_of40="--target-itl-ms 40"
# each starts with its own empty Triton cache (cold), then the RESTARTS variants (default
# "after") are restarted on their warm caches (RESTART=0 skips them; RESTART_PHASES, default
# PHASES or "first16k,hello", what a restarted server is probed with); SHARED_CACHE=1: every variant on one cache, warm after the
# first (a call that compares steady figures, not starts, spends ~15 s less a variant). ~2.7 min a variant. SMOKE=1: the script on the CPU, a tiny shape. Results: $OUT/NAME.tgz per server (packed as
# each ends, so a cut-short call keeps them; the device returns at most 8 files): the probe's
# stalls-NAME.json, the serve log, the step trace (steps-NAME.jsonl: `gpu/schedule_sim.py
# --fit` reads it; the code in .before/ may not write one), /metrics once a second
# (scrapes-NAME.jsonl: `gpu/latency_replay.py replay` reads it); ready.txt; table.txt.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUTD=${OUT:-/tmp/zerod-stalls}; mkdir -p "$OUTD"
W=/tmp/zerod-stalls-work; rm -rf "$W"; mkdir -p "$W"   # each server's files, packed into $OUTD/NAME.tgz
. gpu/parts/wheels.sh xgrammar
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 17408 --max-num-seqs 256"; PROBE_X=""
if [ "${SMOKE:-0}" = 1 ]; then   # the script on the CPU, a tiny shape: checks it, measures nothing
    SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 32 --kv-cache-memory-bytes 64MiB"
    PHASES=${PHASES:-hello,burst200}; PROBE_X="--vocab 1000"
fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
ROOT=$PWD
VARIANTS=${VARIANTS:-before after}
serve() {   # serve DIR NAME CACHE [TUNING [ARGS]]: start, wait for /health, print the seconds to READY
    local dir=$1 name=$2
    ( cd "$dir" && TRITON_CACHE_DIR=$3 ZEROD_TUNING=${4:-} ZEROD_STEP_TRACE=$W/steps-$name.jsonl exec $PY -m zerod serve --model "$M" --load-format dummy --port 8000 \
        $SERVE_X ${5:-} ) > "$W/serve-$name.log" 2>&1 &
    SPID=$!
    local t0=$(date +%s.%N)
    [ "$($PY gpu/wait_health.py 8000 240 $SPID)" = ok ] || { tail -20 "$W/serve-$name.log"; kill $SPID; pack $name; return 1; }
    echo "$name ready_s $(awk "BEGIN{print $(date +%s.%N) - $t0}")" | tee -a "$OUTD/ready.txt"
}
stop() { kill -TERM $SPID; wait $SPID 2>/dev/null; }
pack() { (cd "$W" && tar czf "$OUTD/$1.tgz" $(ls | grep -E -- "-$1\.(json|log|jsonl)$")); }
variant() {   # variant NAME: its tree, tuning and serve flags into dir, tuning, args
    dir=$ROOT; [ $1 = before ] && dir=$ROOT/.before
    tuning=""; args=""
    if [ $1 != before ] && [ $1 != after ]; then
        local tv=TUNING_$1 av=ARGS_$1
        tuning=${!tv:-}; args=${!av:-}
        [ -n "$tuning$args" ] || { echo "variant $1: set TUNING_$1 and/or ARGS_$1" >&2; return 1; }
    fi
    cache=/tmp/triton-$1; [ "${SHARED_CACHE:-0}" != 1 ] || cache=/tmp/triton-shared
}
for v in $VARIANTS; do
    variant $v || continue
    serve "$dir" $v $cache "$tuning" "$args" || continue
    # /metrics once a second: `gpu/latency_replay.py replay` reads which LatencyRegression
    # the daemon's default rules would raise over this traffic
    $PY gpu/latency_replay.py record http://127.0.0.1:8000/metrics "$W/scrapes-$v.jsonl" &
    RECPID=$!
    timeout 300 $PY gpu/stalls_probe.py 8000 "$W/stalls-$v.json" ${PHASES:+--phases $PHASES} $PROBE_X
    kill $RECPID
    echo "$v slow-launch log lines: $(grep -c 'to launch' "$W/serve-$v.log")" | tee -a "$OUTD/ready.txt"
    stop; pack $v
done
# restarts on each variant's warm cache: RESTARTS (default "after"; RESTART=0: none)
[ "${RESTART:-1}" = 1 ] || RESTARTS=""
for v in ${RESTARTS-after}; do
    [[ " $VARIANTS " == *" $v "* ]] && variant $v || continue
    serve "$dir" $v-restart $cache "$tuning" "$args" || continue
    timeout 60 $PY gpu/stalls_probe.py 8000 "$W/stalls-$v-restart.json" --phases ${RESTART_PHASES:-${PHASES:-first16k,hello}} $PROBE_X
    stop; pack $v-restart
done
$PY - "$W" "$OUTD" $VARIANTS > "$OUTD/table.txt" <<'PYEOF'
import json, sys, os
d, outd, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
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
        ("200 streams, first wave: output tokens/s", ("burst200", "first", "output_tokens_per_s")),
        ("200 streams, second wave: output tokens/s", ("burst200", "second", "output_tokens_per_s"))]
print("| figure | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
for name, k in rows:
    print(f"| {name} | " + " | ".join(f(g(runs[v], *k)) for v in variants) + " |")
for v in variants:
    print(f"slow steps ({v}, cumulative at the end of mix25):", g(runs[v], "mix25", "slow_steps_after"))
print(open(os.path.join(outd, "ready.txt")).read())
PYEOF
cat "$OUTD/table.txt"
