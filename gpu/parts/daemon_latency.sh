#!/usr/bin/env bash
# The learned latency normal against a rogue job on the H200, in one call (~3 min): `zerod run` with the default config (no
# SLO set: LatencyRegression against the learned normal), a dummy 8B engine under steady
# load (LOAD: 32 closed-loop streams by default; mixR is `zerod bench --scenario mix` at R
# requests a second, Poisson, prompts 32-4,096 — mix25 runs the H200 near its capacity), the
# normal learned for LEARN (95) s, then a rogue job (16 GiB, bf16 matmuls in a
# loop, gpu/rogue_job.py) — how long until a LatencyRegression fires, and whether it names the
# job. The compute-mode prevention is not shown here: this workplace's device rules forbid
# changing a lent GPU's compute mode (tested against a fake NVML in tests/). Results: $OUT/latency.tgz
# (with the engine's scrapes at 1 Hz in scrapes.jsonl: gpu/latency_replay.py replays them offline).
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOAD=${LOAD:-streams32}
[[ $LOAD =~ ^(mix|streams)[0-9]+$ ]] || { echo "LOAD=$LOAD: streamsN or mixR (whole numbers)" >&2; exit 2; }
[[ ${LEARN:-95} =~ ^[0-9]+$ ]] || { echo "LEARN=$LEARN: whole seconds" >&2; exit 2; }
FINAL=${OUT:-/tmp/zerod-latency}; mkdir -p "$FINAL"
W=/tmp/lat; rm -rf "$W"; mkdir -p "$W/run"
pack() { tar czf "$FINAL/latency.tgz" -C "$W" . 2>/dev/null; }
stamp() { echo "== $(date -u +%T) $*" | tee -a "$W/timeline.txt"; }
. gpu/parts/wheels.sh xgrammar   # packages the device image lacks (xgrammar, psutil), carried in .whl
# SMOKE=1: the same steps on the CPU (tiny shape, short waits, no rogue job): checks the script
SHAPE=8b; DEV=cuda; DT=bfloat16; LEARN=${LEARN:-95}; ROGUE="$PY gpu/rogue_job.py 16 60"
if [ "${SMOKE:-0}" = 1 ]; then SHAPE=tiny; DEV=cpu; DT=float32; LEARN=8; ROGUE="sleep 20"; fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
. gpu/parts/daemon_up.sh   # zerod run, default config + this dummy engine; DPID
if [[ $LOAD == mix* ]]; then
    R=${LOAD#mix}; LOADARGS="--scenario mix --request-rate $R --num-prompts $((200 * R))"
else
    LOADARGS="--input-len 128 --output-len 512 --max-concurrency ${LOAD#streams} --num-prompts 100000"
fi
stamp "load: $LOAD"
timeout -k 10 -s INT 200 $PY -m zerod bench --port 8000 --no-progress $LOADARGS --warmup 0 \
    --out "$W/load.json" > "$W/load.txt" 2>&1 &
LPID=$!
$PY gpu/latency_replay.py record http://127.0.0.1:8000/metrics "$W/scrapes.jsonl" &
RECPID=$!
sleep $LEARN
stamp "rogue job starts"
$ROGUE > "$W/rogue.txt" 2>&1 &
RPID=$!
T0=$(date +%s.%N)
$PY - "$W/run/control.sock" "$T0" > "$W/regression.json" <<'PYEOF'
import json, socket, sys, time
sock, t0 = sys.argv[1], float(sys.argv[2])
def get(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect(sock)
    s.sendall(f"GET {path} HTTP/1.0\r\nHost: zerod\r\n\r\n".encode())
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    return json.loads(buf.partition(b"\r\n\r\n")[2])
# a LatencyRegression already firing before the job starts is the traffic's, not the job's
out = {"fired": False, "firing_before": [a for a in get("/v1/alerts")["alerts"]
                                         if a["state"] == "firing" and a["alertname"] == "LatencyRegression"]}
while time.time() - t0 < 60:
    alerts = [a for a in get("/v1/alerts")["alerts"] if a["state"] == "firing"]
    reg = [a for a in alerts if a["alertname"] == "LatencyRegression"]
    if reg:
        out.update({"fired": True, "after_s": round(time.time() - t0, 1), "alert": reg[0],
                    "foreign_after": [a for a in alerts if a["alertname"] == "ForeignGpuProcess"]})
        break
    time.sleep(0.5)
out["engine"] = get("/v1/engine")
print(json.dumps(out, indent=1, default=str))
PYEOF
stamp "regression watch done"
kill $RPID 2>/dev/null; wait $RPID 2>/dev/null
sleep 5
$PY -c "import socket,json;s=socket.socket(socket.AF_UNIX);s.connect('$W/run/control.sock');s.sendall(b'GET /v1/alerts HTTP/1.0\r\nHost: z\r\n\r\n');b=b''
while (c:=s.recv(65536)): b+=c
print(b.partition(b'\r\n\r\n')[2].decode())" > "$W/alerts-after.json" 2>&1
kill -INT $LPID 2>/dev/null; wait $LPID 2>/dev/null
kill $RECPID 2>/dev/null
kill -TERM $DPID; wait $DPID; echo "daemon exit $?" | tee -a "$W/timeline.txt"
pack
$PY - "$W/regression.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("LatencyRegression firing before the rogue job:", len(d.get("firing_before", [])))
print("LatencyRegression fired:", d.get("fired"), "after", d.get("after_s"), "s (target <= 20 s)")
a = d.get("alert") or {}
print("summary:", a.get("summary")); print("description:", (a.get("description") or "")[:600])
print("labels:", a.get("labels"))
e = d.get("engine", {})
print("engine p99 ITL now / normal:", e.get("itl_p99_s"), e.get("itl_normal_p99_s"), " TTFT:", e.get("ttft_p99_s"), e.get("ttft_normal_p99_s"))
PYEOF
# the replay has no GPU process watcher: the job goes in when the live daemon first saw it.
# The job is stopped at the live alert, so the recording holds only its first seconds: a
# replay may judge them short of a verdict the live daemon reached.
SEEN=$($PY -c "import json,sys
t0 = json.loads(open(sys.argv[1]).readline())['t']
seen = [a['starts_at'] for a in json.load(open(sys.argv[2])).get('alerts', []) if a['alertname'] == 'ForeignGpuProcess']
print(f'foreign_at={min(seen) - t0:.1f}' if seen else '')" "$W/scrapes.jsonl" "$W/alerts-after.json" 2>/dev/null)
echo "the recorded scrapes replayed offline (gpu/latency_replay.py $SEEN; t_s from the first scrape):"
$PY gpu/latency_replay.py replay "$W/scrapes.jsonl" $SEEN 2>/dev/null | cut -c1-400
