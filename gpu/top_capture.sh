#!/usr/bin/env bash
# Issue 35's H200 capture, in one call (~4 min): `zerod run` with the default config and a
# dummy 8B engine under load (32 streams), then a rogue job on the GPU (16 GiB, bf16 matmuls,
# gpu/rogue_job.py, named "trainer"), and once the daemon has seen it: `zerod top` captured at
# 160x48, 120x40 and 80x24 (SVG) with `zerod top --once --json` and `--once` text of the same
# moment (gpu/top_screenshot.py), then the process tree at 160x48. Then the daemon is stopped
# and `zerod top --once --json` reads the host itself (standalone mode), the job still running.
#   OUT=DIR gpu/top_capture.sh          (SMOKE=1: the same steps on the CPU, a tiny model, no job)
# Results in $OUT: zerod-top-h200-*.svg/json/txt, standalone.json/txt, timeline.txt, daemon.log.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-top}; mkdir -p "$FINAL"
W=/tmp/topcap; rm -rf "$W"; mkdir -p "$W/run"
stamp() { echo "== $(date -u +%T) $*" | tee -a "$W/timeline.txt"; }
finish() {
    kill $RPID $LPID 2>/dev/null; kill $DPID 2>/dev/null; wait 2>/dev/null
    cp "$W/timeline.txt" "$W/daemon.log" "$W/doctor.json" "$FINAL/" 2>/dev/null
}
# the sourced helpers sit in gpu/ or, in the entry-point layout, in gpu/parts/
helper() { if [ -f "gpu/parts/$1" ]; then echo "gpu/parts/$1"; else echo "gpu/$1"; fi; }
. "$(helper wheels.sh)" xgrammar psutil textual   # what the device image lacks, carried in .whl
SHAPE=8b; DEV=cuda; DT=bfloat16; ROGUE="$PY gpu/rogue_job.py 16 240"
if [ "${SMOKE:-0}" = 1 ]; then SHAPE=tiny; DEV=cpu; DT=float32; ROGUE="sleep 240"; fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
RPID=; LPID=
. "$(helper daemon_up.sh)"   # zerod run, default config + this dummy engine, socket $W/run/control.sock; DPID
trap finish EXIT
stamp "load: 32 streams"
timeout 300 $PY -m zerod bench --port 8000 --no-progress --input-len 128 --output-len 512 \
    --max-concurrency 32 --num-prompts 100000 --warmup 0 --out "$W/load.json" > "$W/load.txt" 2>&1 &
LPID=$!
sleep 30   # the engine's history and latency figures fill
stamp "rogue job starts"
$ROGUE > "$W/rogue.txt" 2>&1 &
RPID=$!
for _ in $(seq 60); do grep -q ready "$W/rogue.txt" 2>/dev/null && break; [ "${SMOKE:-0}" = 1 ] && break; sleep 1; done
sleep 10   # the process watcher sees it (<= 2 s), ForeignGpuProcess fires, latency moves
stamp "capture"
$PY gpu/top_screenshot.py "$W/run/control.sock" --out "$FINAL" --polls 5 --sizes 160x48,120x40,80x24 \
    | tee -a "$W/timeline.txt"
mkdir -p "$W/tree"
$PY gpu/top_screenshot.py "$W/run/control.sock" --out "$W/tree" --polls 3 --sizes 160x48 --keys t > /dev/null
cp "$W/tree/zerod-top-h200-160x48.svg" "$FINAL/zerod-top-h200-tree-160x48.svg"
stamp "daemon stops; standalone"
kill $DPID; wait $DPID 2>/dev/null; DPID=
$PY -m zerod top --once --json --socket "$W/run/control.sock" > "$FINAL/standalone.json"
COLUMNS=160 $PY -m zerod top --once --socket "$W/run/control.sock" > "$FINAL/standalone.txt"
stamp "done"
