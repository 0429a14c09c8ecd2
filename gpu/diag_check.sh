#!/usr/bin/env bash
# On the device H200 (`run` tool): `zerod diag --level quick --json` and `--level full
# --json` side by side with an independent measurement in the same call (a
# device-to-device copy and a bf16 matmul through plain torch: gpu/diag_reference.py),
# then doctor's gpu.diag on the kept result, the /metrics lines a daemon would export,
# the GPU tests of tests/test_diag_gpu.py, and a short table. Everything lands in $OUT.
set -u
cd "$(dirname "$0")/.."
. gpu/parts/wheels.sh psutil click prometheus_client pynvml  # what the device image may lack, from .whl/
OUT=${OUT:-/tmp/diag-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STATE_DIRECTORY="$OUT/state"
exec > >(tee "$OUT/log.txt") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname) $(nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader)"
echo "== 1. plain torch, before"
python3 gpu/diag_reference.py > "$OUT/reference-before.jsonl"; cat "$OUT/reference-before.jsonl"
echo "== 2. zerod diag --level quick"
python3 -m zerod diag --level quick --json > "$OUT/diag-quick.json"; echo "exit $?"
python3 -m zerod diag --level quick > "$OUT/diag-quick.txt"; echo "exit $?"; cat "$OUT/diag-quick.txt"
echo "== 3. zerod diag --level full"
python3 -m zerod diag --level full --json > "$OUT/diag-full.json"; echo "exit $?"
echo "== 4. plain torch, after"
python3 gpu/diag_reference.py > "$OUT/reference-after.jsonl"; cat "$OUT/reference-after.jsonl"
echo "== 5. doctor shows the kept result (gpu.diag)"
python3 -m zerod doctor --only gpu.diag --only gpu.count --only gpu.stuck_processes --only host.disk_space -v \
    > "$OUT/doctor.txt"; echo "exit $?"; cat "$OUT/doctor.txt"
echo "== 6. what /metrics exports of it"
python3 - "$OUT/state/diag.json" <<'PY' > "$OUT/metrics.txt"
import sys
from prometheus_client import CollectorRegistry, generate_latest
from zerod.alerts import AlertBook
from zerod.diag.service import DiagService
svc = DiagService(AlertBook(), sys.argv[1], engines=lambda: [])
reg = CollectorRegistry(auto_describe=False)
class C:
    def collect(self):
        yield from svc.collect()
reg.register(C())
print(generate_latest(reg).decode())
PY
grep -v "^#" "$OUT/metrics.txt" | head -40
echo "== 7. GPU tests"
python3 -m pytest tests/test_diag_gpu.py -q -p no:cacheprovider 2>&1 | tail -15
echo "== 8. table"
cat "$OUT/reference-before.jsonl" "$OUT/reference-after.jsonl" > "$OUT/reference.jsonl"
python3 gpu/diag_table.py "$OUT/diag-quick.json" "$OUT/diag-full.json" "$OUT/reference.jsonl" | tee "$OUT/table.txt"
