#!/usr/bin/env bash
# One device call for the kernels: tools check, pytest (gpu), memcheck, graph/sync check + bench.
# Usage (device tool, repo root):  bash gpu/kernels.sh triton [COMMIT]
# Writes under $OUT: env.txt, pytest.log, memcheck.log, bench.log, bench.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels_out}; mkdir -p "$OUT"
export ZEROD_COMMIT=${1:-unknown}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c 'import zerod.engine.kernels as k; print("CUDA_KERNELS:", sorted(k.CUDA_KERNELS), k.IMPORT_ERROR)'
# 1. the GPU tests (also warms Triton's cache for the memcheck run)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -5
# 2. memcheck: warm the cache without the sanitizer, then under it (SKIP_MEMCHECK=1 skips)
if [ "${SKIP_MEMCHECK:-0}" != 1 ]; then
  python3 gpu/kernels_memcheck.py > /dev/null 2>&1
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 gpu/kernels_memcheck.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit code: $?" | tee -a "$OUT/memcheck.log"
  tail -14 "$OUT/memcheck.log"
fi
# 3. checks, graph capture under sync-debug, timings (table last)
timeout ${BENCH_TIMEOUT:-240} python3 gpu/kernels_bench.py 2>&1 | tee "$OUT/bench.log"
