#!/usr/bin/env bash
# One call (~5 min) for issue 12's next step: the FP8 products per M (gpu/fp8_gemm_bench.py,
# MS=1,4,16,200), where a decode step's device time goes for FP8 at two --max-model-len
# and for bf16 (gpu/decode_profile.py), then the GPU tests of the FP8 and prefill-graph
# paths. Results in $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
O=${OUT:-/tmp/fp8_probe}; mkdir -p "$O"
. gpu/wheels.sh compressed_tensors peft
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; } > "$O/env.txt" 2>&1
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
OUT="$O" MS=${MS:-1,4,16,200} SWEEP=0 timeout 150 $PY gpu/fp8_gemm_bench.py > "$O/fp8_gemm.txt" 2>&1
echo "gemm: rc $?"; sed -n '/^us per call/,$p' "$O/fp8_gemm.txt"
for v in "fp8-17408 --quantization fp8 --max-model-len 17408" "fp8-4096 --quantization fp8 --max-model-len 4096" \
         "bf16-17408 --max-model-len 17408"; do
  set -- $v; name=$1; shift
  timeout 150 $PY gpu/decode_profile.py "$M" "$O/profile-$name.json" "$@" > "$O/profile-$name.txt" 2>&1
  echo "profile $name: rc $?"; grep -A14 "^==" "$O/profile-$name.txt" | cut -c1-130
done
timeout ${TESTS_TIMEOUT:-200} $PY -m pytest -q -p no:randomly -m gpu tests/test_fp8_kernels.py tests/test_fp8_checkpoints.py \
    tests/test_lora_kernels.py tests/test_engine_gpu.py > "$O/gpu-tests.txt" 2>&1
echo "gpu tests: $(tail -1 "$O/gpu-tests.txt")"; grep -E "^(FAILED|ERROR)" "$O/gpu-tests.txt" | head
