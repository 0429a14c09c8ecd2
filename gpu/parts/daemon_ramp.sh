#!/usr/bin/env bash
# The learned latency normal under changing load on the H200: no LatencyRegression while
# load ramps 8 -> 200 -> 8 streams and back, or while mixed traffic changes rate, with the
# default config (no SLO: the learned normal). `zerod run`, a dummy 8B engine, then STAGES
# of STAGE_S seconds each, the control API's alerts polled every 2 s throughout. A stage is
# a number of closed-loop streams of 128 in / 256 out (default: 8 32 64 128 200 128 64 32 8)
# or mixR: `zerod bench --scenario mix` at R requests a second (Poisson; prompts 32-4,096,
# outputs 16-512). Ten minutes of mixed 10 and 25 req/s:
#   STAGES="mix10 mix25 mix10 mix25" STAGE_S=150 (detached as below)
# STAGE_S=67 gives the 10-minute ramp; with its setup that outlasts one device call (10
# minutes), so start it detached and collect it in a second call right after the first;
# the first brings back what it has so far (a machine can be taken back between the calls):
#   call 1: mkdir -p /tmp/rampout; setsid nohup env OUT=/tmp/rampout STAGE_S=67 bash gpu/daemon.sh ramp \
#           > /tmp/rampout/ramp.log 2>&1 < /dev/null & sleep 570; cat /tmp/ramp/timeline.txt; tar czf $OUT/ramp-part.tgz -C /tmp/ramp .
#   call 2: while [ ! -f /tmp/rampout/ramp.tgz ]; do sleep 5; done; cp /tmp/rampout/* $OUT/
# Results: $OUT/ramp.tgz (timeline, every alert seen, the engine's p99s and their learned
# normals every 2 s in engine.jsonl, the engine's scrapes at 1 Hz in scrapes.jsonl for
# gpu/latency_replay.py, the daemon log). A stage's client is stopped by its timeout.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-ramp}; mkdir -p "$FINAL"
W=/tmp/ramp; rm -rf "$W"; mkdir -p "$W/run"
stamp() { echo "== $(date -u +%T) $*" | tee -a "$W/timeline.txt"; }
. gpu/parts/wheels.sh xgrammar   # packages the device image lacks (xgrammar, psutil), carried in .whl
SHAPE=8b; DEV=cuda; DT=bfloat16; STAGE_S=${STAGE_S:-60}; STAGES=${STAGES:-8 32 64 128 200 128 64 32 8}
if [ "${SMOKE:-0}" = 1 ]; then SHAPE=tiny; DEV=cpu; DT=float32; STAGE_S=${STAGE_S:-8}; STAGES=${STAGES:-2 80 2}; fi   # 80 streams: two client processes
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
. gpu/parts/daemon_up.sh   # zerod run, default config + this dummy engine; DPID
# every alert the daemon shows under load: one JSON line per poll that sees any, and each
# alert's start and end in the timeline as they happen (a run whose files never come back
# still names them in the console)
$PY - "$W/run/control.sock" "$W/timeline.txt" > "$W/alerts.jsonl" 2> "$W/engine.jsonl" <<'PYEOF' &
import json, sys, time
sys.path.insert(0, "gpu")
from control_wait import get
active = {}
while True:
    try:
        alerts = get(sys.argv[1], "/v1/alerts")["alerts"]
        eng = get(sys.argv[1], "/v1/engine")
    except OSError:
        break
    now = {a["id"]: a for a in alerts}
    changes = [f"alert firing: {a['id']} ({a.get('severity')}): {a.get('summary')}"
               for i, a in now.items() if i not in active]
    changes += [f"alert ended: {i}" for i in active if i not in now]
    active = now
    if changes:
        with open(sys.argv[2], "a") as tl:
            for c in changes:
                line = f"== {time.strftime('%H:%M:%S', time.gmtime())} {c}"
                print(line, file=tl)
    if alerts:
        print(json.dumps({"t": time.time(), "alerts": alerts}), flush=True)
    print(json.dumps({"t": time.time(), "running": eng.get("running"),
                      "itl_p99_s": eng.get("itl_p99_s"), "itl_normal_p99_s": eng.get("itl_normal_p99_s"),
                      "ttft_p99_s": eng.get("ttft_p99_s"), "ttft_normal_p99_s": eng.get("ttft_normal_p99_s")}),
          file=sys.stderr, flush=True)
    time.sleep(2)
PYEOF
APID=$!
# the engine's scrapes, 1 Hz, for gpu/latency_replay.py (the verdict re-read offline)
$PY gpu/latency_replay.py record http://127.0.0.1:8000/metrics "$W/scrapes.jsonl" &
RPID=$!
SEED=0
for C in $STAGES; do
    # new prompts every stage: with one seed each stage replayed the stage before's prompts
    # (prefix-cache hits) until it ran past them — a change of work the detector rightly saw
    SEED=$((SEED + 1))
    if [[ $C == mix* ]]; then   # Poisson arrivals; twice the stage's requests, so it never runs dry
        R=${C#mix}; stamp "stage: mixed traffic at $R req/s for ${STAGE_S}s"
        LOAD="--scenario mix --request-rate $R --num-prompts $((2 * R * STAGE_S))"
    else            # closed loop: enough requests to outlast the stage (a request takes > 1 s)
        stamp "stage: $C streams for ${STAGE_S}s"
        LOAD="--input-len 128 --output-len 256 --max-concurrency $C --num-prompts $((4 * C * STAGE_S))"
    fi
    timeout -k 10 -s INT "$STAGE_S" $PY -m zerod bench --port 8000 --no-progress $LOAD --warmup 0 \
        --seed "$SEED" >> "$W/load.txt" 2>&1
done
stamp "load done"
sleep 3
kill $APID $RPID 2>/dev/null
kill -TERM $DPID; wait $DPID; echo "daemon exit $?" | tee -a "$W/timeline.txt"
tar czf "$FINAL/ramp.tgz" -C "$W" . 2>/dev/null
$PY - "$W/alerts.jsonl" <<'PYEOF'
import json, sys
seen = {}
for line in open(sys.argv[1]):
    for a in json.loads(line)["alerts"]:
        seen.setdefault((a["alertname"], a["state"]), a)
reg = [a for (name, _), a in seen.items() if name == "LatencyRegression"]
print("alerts seen under load:", sorted({k[0] for k in seen}) or "none")
print("LatencyRegression under load:", "YES" if reg else "none", "(target: none)")
for a in reg:
    print("  ", a.get("summary"), "|", (a.get("description") or "")[:300])
PYEOF
echo "the recorded scrapes replayed offline (gpu/latency_replay.py):"
$PY gpu/latency_replay.py replay "$W/scrapes.jsonl" | tail -4
