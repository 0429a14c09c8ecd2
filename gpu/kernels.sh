#!/usr/bin/env bash
# Are the engine's kernels right, and how close to the GPU's ceilings do they run? Each
# PART checks every kernel against its torch reference before it times anything.
#
#   bash gpu/kernels.sh [PART] [ARGS...]      results under $OUT
#
# PART (default triton):
#   triton    the Triton kernels of engine/kernels/: GPU tests, compute-sanitizer memcheck,
#             a CUDA-graph capture under sync-debug, then each kernel timed inside CUDA graphs
#             with the HBM copy and bf16 matmul ceilings (SKIP_MEMCHECK=1 skips the sanitizer);
#             `python3 gpu/kernels_table.py $OUT/bench.json` makes the docs/perf.md tables
#   fp8       the FP8 projections per row count M: bf16, W8A8 row-wise and tensorwise, W8A16,
#             and the tile sweep (MS=1,4,16 narrows M; SWEEP=0 skips the sweep)
#   lora      the LoRA delta per projection and per decode step, each decode way and tile
#   profile   where a step's device time goes (torch.profiler over batch-1, 200 streams, the
#             200-stream wave and a 16K prompt); ARGS go to gpu/decode_profile.py
#             (e.g. --quantization fp8)
#   sdpa      what each SDPA backend costs per new sequence length, on the host and device
#   aot       (CPU, no device time) compile the attention kernels for sm_90a: registers,
#             shared memory, spills
# SMOKE=1 runs fp8 and lora through Triton's interpreter on the CPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/zerod-kernels}; mkdir -p "$OUT"; export OUT
PART=${1:-triton}; [ $# -gt 0 ] && shift
case "$PART" in
  triton)  exec bash gpu/parts/kernels_triton.sh "$@" ;;
  fp8)     timeout 540 $PY gpu/fp8_gemm_bench.py 2>&1 | tee "$OUT/fp8_gemm.txt" ;;
  lora)    timeout 540 $PY gpu/lora_kernels_bench.py "$OUT/lora_kernels.json" 2>&1 | tee "$OUT/lora_kernels.txt" ;;
  profile)
    M=/tmp/zerod-dummy-8b
    $PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
    timeout 540 $PY gpu/decode_profile.py "$M" "$OUT/decode_profile.json" "$@" 2>&1 | tee "$OUT/decode_profile.txt" ;;
  sdpa)    timeout 300 $PY gpu/sdpa_shapes.py "$OUT/sdpa_shapes.json" 2>&1 | tee "$OUT/sdpa_shapes.txt" ;;
  aot)     $PY gpu/kernels_aot.py 2>&1 | tee "$OUT/aot.txt" ;;
  help|-h|--help)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d' ;;
  *)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d'; echo "unknown part: $PART" >&2; exit 2 ;;
esac
