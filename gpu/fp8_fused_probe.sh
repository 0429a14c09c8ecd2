#!/usr/bin/env bash
# The FP8 activation quantization fused into the RMSNorm / SiLU·mul before (FUSED_ACT_QUANT),
# one call (~5 min): the GPU tests of the changed kernels and paths, then where a decode
# step's device time goes with it on and off (gpu/decode_profile.py, FP8 8B shape, two
# rounds alternating). Results in $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
O=${OUT:-/tmp/fp8_fused}; mkdir -p "$O"
. gpu/wheels.sh compressed_tensors peft
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$O/env.txt" 2>&1
timeout 240 $PY -m pytest -q -p no:randomly -m gpu tests/test_fp8_kernels.py tests/test_fp8_checkpoints.py \
    tests/test_kernels_gpu.py tests/test_engine_gpu.py > "$O/gpu-tests.txt" 2>&1
echo "gpu tests: $(tail -1 "$O/gpu-tests.txt")"; grep -E "^(FAILED|ERROR)|BAD" "$O/gpu-tests.txt" | head
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
for round in 1 2; do
  for v in fused unfused; do
    flag=""; [ $v = unfused ] && flag=--unfused-act-quant
    timeout 120 $PY gpu/decode_profile.py "$M" "$O/profile-$v-$round.json" --quantization fp8 $flag \
        > "$O/profile-$v-$round.log" 2>&1
    echo "$v round $round: rc $?"; grep -A12 "^==" "$O/profile-$v-$round.log" | cut -c1-120
  done
done
