#!/usr/bin/env bash
# On the device H200 (`run` tool): doctor on the idle GPU, timed; then two stand-in
# monitoring agents - one holding ~2 GiB under the name dcgm-exporter (NVML lists it),
# one that only calls nvmlInit under the name datadog-agent (only the fd scan finds
# it) - and doctor again, which must name both with their fix. Everything lands in $OUT.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/doctor-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
echo "== 1. doctor on the idle host"
python3 -m zerod doctor --json --save-facts "$OUT/h200-facts.json" > "$OUT/doctor-idle.json"; echo "exit $?"
python3 -m zerod doctor > "$OUT/doctor-idle.txt"; echo "exit $?"; cat "$OUT/doctor-idle.txt"
python3 -m zerod.bench.doctor_walltime -n 11 --out "$OUT/walltime.json"
echo "== 2. two stand-in agents"
# exec -a sets argv[0] to the agent's name; Python then cannot find its venv from
# argv[0], so hand it the same sys.path explicitly.
PYPATH=$(python3 -c 'import sys; print(":".join(p for p in sys.path if p))')
(export PYTHONPATH=$PYPATH; exec -a dcgm-exporter python3 gpu/doctor_agent.py dcgm-exporter alloc 2 > /tmp/agent1.out 2>&1) &
A1=$!
(export PYTHONPATH=$PYPATH; exec -a datadog-agent python3 gpu/doctor_agent.py datadog-agent nvml > /tmp/agent2.out 2>&1) &
A2=$!
for _ in $(seq 60); do grep -q ready /tmp/agent1.out && grep -q ready /tmp/agent2.out && break; sleep 0.5; done
cat /tmp/agent1.out /tmp/agent2.out
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
python3 -m zerod doctor --json --save-facts "$OUT/h200-facts-foreign.json" > "$OUT/doctor-foreign.json"; echo "exit $?"
python3 -m zerod doctor --only gpu.foreign_processes --only gpu.memory_headroom -v > "$OUT/doctor-foreign.txt"; echo "exit $?"
cat "$OUT/doctor-foreign.txt"
echo "== 3. cost of one scan (the daemon runs it every second)"
python3 - <<'PY'
import os, statistics, time
from zerod.checks.gpu_processes import scan_gpu_processes, classify, is_foreign
scan_gpu_processes()  # nvmlInit once
ts = []
for _ in range(50):
    t = time.perf_counter(); procs = scan_gpu_processes(); ts.append((time.perf_counter() - t) * 1000)
print(f"scan_gpu_processes: median {statistics.median(ts):.2f} ms, max {max(ts):.2f} ms over 50")
for p in procs:
    print(p.pid, p.name, p.source, p.gpu_memory_bytes, classify(p, [os.getpid()], ()))
PY
kill $A1 $A2 2>/dev/null; wait $A1 $A2 2>/dev/null  # not a bare wait: tee above never ends
echo "== done $(date -u +%FT%TZ)"
