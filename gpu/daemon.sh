#!/usr/bin/env bash
# Does the daemon see what it claims to see, in time, on a real GPU? Each PART runs
# `zerod doctor` or `zerod run` on the H200 against stand-ins for what goes wrong on
# inference hosts (monitoring agents on the GPU, a rogue training job, a load ramp).
#
#   bash gpu/daemon.sh [PART]      results under $OUT
#
# PART (default run):
#   doctor    doctor on the idle GPU (wall time), then beside two stand-in agents: one
#             holding GPU memory (NVML lists it), one that only calls nvmlInit (only the fd
#             scan finds it); doctor must name both with their fix
#   run       `zerod run` with a dummy 8B engine: READY and WATCHDOG to a fake systemd, the
#             time from a foreign process on the GPU to its alert, the daemon's CPU while
#             watching; under load, `zerod top` captured headless on its control socket
#             (textual carried in .whl/, docs/tui.md)
#   latency   steady load (LOAD: 32 streams, or mixR: mixed traffic at R req/s), the normal
#             learned for 90 s, then a rogue job: how long until a
#             LatencyRegression fires, and whether it names the job
#   ramp      8 -> 200 -> 8 streams in nine stages (STAGE_S each; 67 gives ten minutes and
#             outlasts one call: see the part's header), or STAGES of mixed traffic
#             ("mix10 mix25 ..."): no LatencyRegression may fire
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PART=${1:-run}; [ $# -gt 0 ] && shift
case "$PART" in
  doctor|latency|ramp) exec bash "gpu/parts/daemon_$PART.sh" "$@" ;;
  run)
    FINAL=${OUT:-/tmp/zerod-daemon}; mkdir -p "$FINAL"
    . gpu/parts/wheels.sh textual psutil
    # the daemon part runs in the background; load and the dashboard attach to it
    OUT=$FINAL timeout 190 bash gpu/parts/daemon_run.sh > "$FINAL/daemon-console.txt" 2>&1 &
    RUN=$!
    SOCK=$FINAL/daemon/run/control.sock
    $PY gpu/control_wait.py "$SOCK" healthy 150
    sleep 24   # the daemon's idle-CPU window stays unloaded
    timeout 80 $PY -m zerod bench --port 8000 --input-len 512 --output-len 512 --num-prompts 96 \
        --max-concurrency 32 --warmup 0 --no-progress --out "$FINAL/daemon-load.json" > "$FINAL/daemon-load.txt" 2>&1 &
    LOAD=$!
    $PY gpu/control_wait.py "$SOCK" foreign 40   # the screenshot shows a foreign process on the GPU
    timeout 40 $PY gpu/top_screenshot.py "$SOCK" --out "$FINAL/top" --polls 3 > "$FINAL/top-console.txt" 2>&1
    wait $LOAD; wait $RUN; echo "daemon part rc $?"
    tail -14 "$FINAL/daemon-console.txt"; tail -3 "$FINAL/top-console.txt" ;;
  help|-h|--help)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d' ;;
  *)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d'; echo "unknown part: $PART" >&2; exit 2 ;;
esac
