#!/usr/bin/env bash
# One device call for the whole product's GPU evidence (device time is short, each
# machine start costs a minute): run from the repo root on the H200 with the
# textual wheels carried in .whl/ (docs/tui.md).
#   1. doctor on the idle GPU, then with two stand-in agents     (gpu/doctor_evidence.sh)
#   2. the daemon with a dummy 8B engine: READY, foreign-process detection time,
#      daemon CPU (gpu/daemon_evidence.sh); meanwhile load on its engine and
#      `zerod top` attached to it (gpu/top_screenshot.py)
#   3. the serving benchmark through HTTP                        (gpu/server_bench.sh)
#   4. HF transformers on the same shapes, same call             (bench/hf_compare.py)
#   5. the GPU-marked tests                                      (pytest -m gpu)
# Everything lands in $OUT/evidence.tgz (the tool brings back 8 files at most).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/zerod-final}; mkdir -p "$FINAL"
W=/tmp/ev; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$FINAL/evidence.tgz" -C "$W" . 2>/dev/null; }
stamp() { echo "== $(date -u +%T) $*" | tee -a "$W/timeline.txt"; }
if ! python3 -c 'import textual' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi; } > "$W/env.txt" 2>&1

stamp "1 doctor"
OUT=$W/doctor timeout 75 bash gpu/doctor_evidence.sh > "$W/doctor-console.txt" 2>&1
echo "rc $?" >> "$W/doctor-console.txt"; pack

stamp "2 daemon + top under load"
OUT=$W timeout 190 bash gpu/daemon_evidence.sh > "$W/daemon-console.txt" 2>&1 &
DPID=$!
SOCK=$W/daemon/run/control.sock
python3 gpu/control_wait.py "$SOCK" healthy 150 >> "$W/timeline.txt" 2>&1
sleep 24  # the daemon's idle-CPU window stays unloaded
stamp "load on the daemon's engine"
timeout 80 python3 -m zerod bench --port 8000 --input-len 512 --output-len 512 --num-prompts 96 \
    --max-concurrency 32 --warmup 0 --no-progress --out "$W/daemon-load.json" > "$W/daemon-load.txt" 2>&1 &
LPID=$!
python3 gpu/control_wait.py "$SOCK" foreign 40 >> "$W/timeline.txt" 2>&1  # screenshot with a foreign process on the GPU
stamp "zerod top"
OUT=$W/top timeout 40 python3 gpu/top_screenshot.py "$SOCK" --out "$W/top" --polls 3 > "$W/top-console.txt" 2>&1
wait $LPID; wait $DPID; echo "daemon rc $?" >> "$W/daemon-console.txt"; pack
pkill -f "zerod (serve|run)" 2>/dev/null; sleep 1

stamp "3 serving bench"
OUT=$W READY_TIMEOUT=90 timeout 170 bash gpu/server_bench.sh > "$W/server-console.txt" 2>&1
echo "rc $?" >> "$W/server-console.txt"; pack
pkill -9 -f "zerod serve" 2>/dev/null; sleep 2

stamp "4 HF transformers"
timeout 120 python3 -m zerod.bench.hf_compare --out "$W/hf.json" > "$W/hf-console.txt" 2>&1
echo "rc $?" >> "$W/hf-console.txt"; pack

stamp "5 GPU tests"
timeout 75 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernels_gpu.py > "$W/gpu-tests.txt" 2>&1
echo "rc $?" >> "$W/gpu-tests.txt"
stamp "done"; pack
echo; tail -3 "$W/doctor-console.txt"; tail -14 "$W/daemon-console.txt"; tail -3 "$W/top-console.txt"
tail -25 "$W/server-console.txt"; tail -20 "$W/hf-console.txt"; tail -3 "$W/gpu-tests.txt"; cat "$W/timeline.txt"
