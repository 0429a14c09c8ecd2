#!/usr/bin/env bash
# Issue 32's fault alerts on the device (one call, ~8 min; PHASES to split it): `zerod run` with
# the default config and a dummy 8B engine (gpu/parts/daemon_up.sh), then
#   stall:  ZEROD_FAULT=stall-after-steps:N under 8 streams -> EngineStalled (default
#           stall_after_s 10): how long after the engine's last step (its /health last_step.at),
#           the stack and GPU evidence, the restart, `zerod events`, the flight recorder's bundle;
#   canary: ZEROD_FAULT=corrupt-after-steps:N, canary_interval_s = 10, no other load ->
#           CanaryMismatch: how long after the weights were perturbed (the engine's log line);
#   rogue:  gpu/parts/daemon_latency.sh (32 streams, then gpu/rogue_job.py) -> LatencyRegression's
#           delay after the job started (target <= 10 s), naming it, and its slo label.
# Raw output under $OUT: diag_faults.log, stall/, canary/, latency.tgz.
#   bash gpu/diag_faults.sh                     (carry .whl)
#   PHASES="stall canary" bash gpu/diag_faults.sh ; PHASES=rogue bash gpu/diag_faults.sh
#   SMOKE=1 PHASES="stall canary" bash gpu/diag_faults.sh   (the CPU, a tiny model: checks the script)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-diag-faults}; mkdir -p "$FINAL"
PHASES=${PHASES:-stall canary rogue}
. gpu/parts/wheels.sh xgrammar psutil
SHAPE=8b; DEV=cuda; DT=bfloat16; STALL_STEPS=${STALL_STEPS:-3000}; CORRUPT_STEPS=${CORRUPT_STEPS:-400}; WAIT=${WAIT:-150}
if [ "${SMOKE:-0}" = 1 ]; then SHAPE=tiny; DEV=cpu; DT=float32; STALL_STEPS=300; CORRUPT_STEPS=150; WAIT=90; fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
LOG="$FINAL/diag_faults.log"
say() { echo "== $(date -u +%T.%N | cut -c1-12) $*" | tee -a "$LOG"; }

daemon_down() {
    kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null; say "daemon exit $?"
}

phase_stall() {
    W=/tmp/diag-stall; rm -rf "$W"; mkdir -p "$W/run"
    trap 'cp -r /tmp/diag-stall "$FINAL/stall" 2>/dev/null' EXIT   # what there is, also on a timeout
    DAEMON_EXTRA="state_dir = \"$W/state\"
canary_interval_s = 0
engine_env = { ZEROD_FAULT = \"stall-after-steps:$STALL_STEPS\" }"
    . gpu/parts/daemon_up.sh
    say "stall: load 8 streams (the engine stalls after $STALL_STEPS steps)"
    timeout 200 $PY -m zerod bench --port 8000 --no-progress --input-len 128 --output-len 512 \
        --max-concurrency 8 --num-prompts 100000 --warmup 0 > "$W/load.txt" 2>&1 &
    LPID=$!
    $PY gpu/alert_wait.py "$W/run/control.sock" EngineStalled $WAIT > "$W/stalled.json"
    say "stall: EngineStalled seen"
    $PY gpu/alert_wait.py "$W/run/control.sock" EngineRestarted 60 > "$W/restarted.json"
    say "stall: EngineRestarted seen"
    sleep 5
    kill -INT $LPID 2>/dev/null; wait $LPID 2>/dev/null
    daemon_down
    $PY -m zerod events --config "$CFG" --since 1h --json > "$W/events.json" 2>&1
    $PY -m zerod events --config "$CFG" --since 1h > "$W/events.txt" 2>&1
    ls -la "$W/state/bundles" > "$W/bundles.txt" 2>&1
    $PY - "$W" <<'PYEOF' | tee -a "$LOG"
import glob, json, sys, tarfile
w = sys.argv[1]
d = json.load(open(f"{w}/stalled.json"))
a = d.get("alert") or {}
print("EngineStalled fired:", d.get("fired"), "after", d.get("after_s"), "s of watching")
steps = [e for e in json.load(open(f"{w}/events.json")) if e["alertname"] == "EngineStalled"]
desc = steps[0]["description"] if steps else a.get("description", "")
last = None
for line in open(f"{w}/daemon.log"):
    if "step loop stops after step" in line:
        last = line.strip()
print("engine's fault line:", last)
if steps:
    print("alert time (event store):", steps[0]["time"], "| starts_at", a.get("starts_at"))
print("summary:", a.get("summary"))
print("description (first 1500 chars):", desc[:1500])
r = json.load(open(f"{w}/restarted.json"))
print("EngineRestarted:", r.get("fired"), (r.get("alert") or {}).get("summary"))
bundles = sorted(glob.glob(f"{w}/state/bundles/*.tar.gz"))
print("flight-recorder bundles:", bundles)
if bundles:
    with tarfile.open(bundles[0]) as t:
        print("  parts:", sorted(m.name.split("/", 1)[1] for m in t.getmembers()))
PYEOF
    cp -r "$W" "$FINAL/stall"
}

phase_canary() {
    W=/tmp/diag-canary; rm -rf "$W"; mkdir -p "$W/run"
    trap 'cp -r /tmp/diag-canary "$FINAL/canary" 2>/dev/null' EXIT
    DAEMON_EXTRA="state_dir = \"$W/state\"
canary_interval_s = 10
engine_env = { ZEROD_FAULT = \"corrupt-after-steps:$CORRUPT_STEPS\" }"
    . gpu/parts/daemon_up.sh
    say "canary: every 10 s, the weights perturbed after $CORRUPT_STEPS steps"
    $PY gpu/alert_wait.py "$W/run/control.sock" CanaryMismatch $((WAIT + 60)) > "$W/mismatch.json"
    say "canary: CanaryMismatch seen"
    curl -s http://127.0.0.1:8000/metrics | grep -E '^zerod_engine_(generation_tokens|requests)_total' > "$W/engine_counters.txt"
    daemon_down
    $PY -m zerod events --config "$CFG" --since 1h --json > "$W/events.json" 2>&1
    $PY - "$W" <<'PYEOF' | tee -a "$LOG"
import json, sys
w = sys.argv[1]
d = json.load(open(f"{w}/mismatch.json"))
a = d.get("alert") or {}
print("CanaryMismatch fired:", d.get("fired"), "after", d.get("after_s"), "s of watching")
for line in open(f"{w}/daemon.log"):
    if "perturbed after step" in line:
        print("engine's fault line:", line.strip())
print("alert starts_at:", a.get("starts_at"))
print("summary:", a.get("summary")); print("description:", a.get("description"))
print("labels:", a.get("labels"))
print("engine counters (the canary is unmetered: 0 expected with no other load):")
print(open(f"{w}/engine_counters.txt").read())
PYEOF
    cp -r "$W" "$FINAL/canary"
}

phase_rogue() {
    say "rogue: gpu/parts/daemon_latency.sh"
    OUT="$FINAL" bash gpu/parts/daemon_latency.sh 2>&1 | tee -a "$LOG"
}

for p in $PHASES; do
    case $p in
        stall) phase_stall ;; canary) phase_canary ;; rogue) phase_rogue ;;
        *) echo "unknown phase $p (stall, canary, rogue)"; exit 2 ;;
    esac
done
say "done"
