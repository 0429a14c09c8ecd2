#!/usr/bin/env bash
# Where a start's seconds go (issue 31's "ready to serve" figures), ~2 min: the 8B shape (dummy
# bf16) served cold on an empty Triton cache, then restarted on the warm cache under py-spy
# (100 samples/s, every thread, collapsed stacks). Results: $OUT/start_profile.tgz (serve logs
# with the engine's per-part start breakdown, restart.folded); gpu/start_profile.py sums it.
#   bash gpu/start_profile.sh      (carry .whl: py-spy)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTD=${OUT:-/tmp/zerod-start}; mkdir -p "$OUTD"; W=/tmp/start-prof; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh xgrammar py_spy
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
ARGS="-m zerod serve --model $M --load-format dummy --port 8000 --dtype bfloat16 --max-model-len 17408 --max-num-seqs 256"
export TRITON_CACHE_DIR=/tmp/triton-start
once() {   # once NAME [PREFIX...]: start, wait for /health, stop
    local name=$1; shift
    local t0=$(date +%s.%N)
    "$@" $PY $ARGS > "$W/serve-$name.log" 2>&1 &
    local pid=$!
    $PY gpu/wait_health.py 8000 240 $pid > "$W/health-$name.txt"
    echo "$name ready_s $(awk "BEGIN{print $(date +%s.%N) - $t0}") $(cat "$W/health-$name.txt")" | tee -a "$W/ready.txt"
    pkill -TERM -f "^$PY -m zerod serve --model $M"; wait $pid 2>/dev/null   # the server, not py-spy
}
once cold
[ "${PROFILE_ONLY:-0}" = 1 ] || once warm
PYSPY=$(ls /tmp/site/bin/py-spy 2>/dev/null || command -v py-spy)
once warm-pyspy "$PYSPY" record -r 100 --threads --idle -f raw -o "$W/restart.folded" --
grep -hE "engine ready|ready on|warmed|captured" "$W"/serve-*.log | cut -c1-300
$PY gpu/start_profile.py "$W/restart.folded" | tee "$W/summary.txt"
tar czf "$OUTD/start_profile.tgz" -C "$W" .
