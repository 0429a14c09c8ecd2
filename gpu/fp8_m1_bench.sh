#!/usr/bin/env bash
# Batch-1 FP8 decode through cuBLASLt's tensorwise GEMM or the Triton W8A16 kernel (H200,
# ~4 min): gpu/fp8_gemm_bench.py at M = 1 and 4 (each product checked against the float32
# reference first, then timed per layer in CUDA graphs, weights cold; "w8a8t" is the
# tensorwise one), then two --quantization fp8 servers of the 8B shape (dummy weights) on
# the GPU at once (gpu/fp8_m1_serve.py: w8a16, tensorwise), batch-1 decode on each in turn,
# REPS rounds. Results: $OUT/fp8_m1.tgz; the tables last. SMOKE=1: the CPU, tiny (the
# tensorwise product is CUDA-only: both servers then run the same code).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-fp8-m1}; mkdir -p "$FINAL"
W=/tmp/fp8_m1; rm -rf "$W"; mkdir -p "$W"
SHAPE=8b; SERVE_X="--dtype bfloat16 --quantization fp8 --max-model-len 4096 --max-num-seqs 16 --kv-pages 2000"
B1="--scenario decode-b1"
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 4"
  B1="--scenario decode-b1 --num-prompts 2 --output-len 8 --warmup 1"
else
  MS=1,4 SWEEP=0 OUT="$W" timeout 200 $PY gpu/fp8_gemm_bench.py > "$W/fp8_gemm.txt" 2>&1
  grep -E "^check|^  M=|tensorwise|FAILED" "$W/fp8_gemm.txt"
fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
declare -A PORT=([w8a16]=8000 [tensorwise]=8001) PID
for v in w8a16 tensorwise; do
  # shellcheck disable=SC2086
  $PY gpu/fp8_m1_serve.py "$v" serve --model "$M" --load-format dummy --port "${PORT[$v]}" $SERVE_X \
      > "$W/serve-$v.log" 2>&1 &
  PID[$v]=$!
done
for v in w8a16 tensorwise; do
  [ "$($PY gpu/wait_health.py "${PORT[$v]}" 300 "${PID[$v]}")" = ok ] || { echo "$v did not start"; tail -20 "$W/serve-$v.log"; }
done
for i in $(seq 1 "${REPS:-3}"); do
  for v in w8a16 tensorwise; do
    # shellcheck disable=SC2086
    timeout 90 $PY -m zerod bench --port "${PORT[$v]}" --no-progress $B1 --out "$W/$v-b1-$i.json" > "$W/$v-b1-$i.txt" 2>&1
  done
done
kill -TERM "${PID[@]}"; wait
tar czf "$FINAL/fp8_m1.tgz" -C "$W" .
$PY - "$W" <<'PYEOF'
import glob, json, os, statistics, sys
W = sys.argv[1]
for v in ("w8a16", "tensorwise"):
    rates, out = [], []   # decode tokens/s per request (TTFT excluded); output tokens/s (fp8_bench.sh's b1)
    for f in sorted(glob.glob(os.path.join(W, f"{v}-b1-*.json"))):
        try:
            r = json.load(open(f))["scenarios"]["decode-b1"]
            rates.append(r["decode_tokens_per_s"]["mean"])
            out.append(r["output_throughput"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    print(f"{v:10} batch-1 decode tokens/s: {', '.join(f'{r:.1f}' for r in rates)}; median {med(rates):.1f} "
          f"(output tokens/s, fp8_bench.sh's b1: median {med(out):.1f})")
print("target (FP8, H200): batch-1 >= 420 tokens/s")
PYEOF
