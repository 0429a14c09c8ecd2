#!/usr/bin/env bash
# The model families on the H200 in one call (~10 min). First the GPU tests: the fused MoE kernel
# (tests/test_families_moe.py) and every family in bf16 with CUDA graphs against transformers
# on the same GPU (tests/test_families_gpu.py); output in $OUT/families-gpu-tests.txt. Then
# the figures: Qwen3-8B, Gemma-2-9B and Mixtral-8x7B shapes
# with dummy weights, each served by zerod and driven through HTTP (batch-1 decode; 200
# streams of 24 in / 128 out: output tokens/s and TTFT), then transformers' batch-1 decode on
# the same config after the server is gone (Mixtral's 93 GB fit the H200 only alone; on
# out-of-memory the HF figure is skipped and says so). Target: Mixtral-8x7B batch-1 >= 115 tok/s.
# Phase times print as they go; raw output in $OUT/families.tgz; a table last.
# SMOKE=1: the same on the CPU with tiny shapes of the three families.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-families}; mkdir -p "$FINAL"
W=/tmp/families; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh psutil   # carried in .whl where the image lacks it
PORT=${PORT:-8000}
SHAPES="qwen3-8b gemma2-9b mixtral-8x7b"; DEV=cuda
SERVE_X="--dtype bfloat16 --max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.90"
B1="--scenario decode-b1 --num-prompts 3 --output-len 256"; S200="--scenario streams-200"; HF_TOK=128
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPES="tiny-qwen3 tiny-gemma2 tiny-mixtral"; DEV=cpu
  SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 16"
  B1="--scenario decode-b1 --num-prompts 2 --output-len 16 --warmup 1"
  S200="--scenario streams-200 --num-prompts 8 --output-len 8 --warmup 1"; HF_TOK=8
fi
T0=$(date +%s)
phase() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
phase "GPU tests"
timeout 420 $PY -m pytest -m gpu -q -p no:cacheprovider -p no:randomly tests/test_families_moe.py \
  tests/test_families_gpu.py > "$FINAL/families-gpu-tests.txt" 2>&1
echo "GPU tests: exit $?, $(tail -1 "$FINAL/families-gpu-tests.txt")" | tee "$W/gpu-tests-summary.txt"
for S in $SHAPES; do
  M=/tmp/zerod-dummy-$S; D="$W/$S"; mkdir -p "$D"
  $PY gpu/families_model.py "$M" --shape "$S" > /dev/null || exit 1
  phase "$S: serve"
  # shellcheck disable=SC2086
  $PY -m zerod serve --model "$M" --load-format dummy --port $PORT $SERVE_X > "$D/serve.log" 2>&1 &
  SPID=$!
  for _ in $(seq 1 1200); do curl -sf -o /dev/null http://127.0.0.1:$PORT/health && break
    kill -0 $SPID 2>/dev/null || break; sleep 0.25; done
  phase "$S: ready ($(grep -o 'engine ready.*' "$D/serve.log" | tail -1))"
  BENCH="$PY -m zerod bench --port $PORT --no-progress"
  # shellcheck disable=SC2086
  timeout 120 $BENCH $B1 --out "$D/b1.json" > "$D/b1.txt" 2>&1
  phase "$S: batch-1 done"
  # shellcheck disable=SC2086
  timeout 120 $BENCH $S200 --out "$D/s200.json" > "$D/s200.txt" 2>&1
  phase "$S: 200 streams done"
  curl -s http://127.0.0.1:$PORT/metrics > "$D/metrics.txt"
  kill -TERM $SPID; wait $SPID
  timeout 180 $PY gpu/families_hf.py "$M" --out "$D/hf.json" --device $DEV --tokens $HF_TOK > "$D/hf.txt" 2>&1 \
    || echo '{"skipped": "transformers failed or timed out (see hf.txt)"}' > "$D/hf.json"
  phase "$S: transformers done"
done
tar czf "$FINAL/families.tgz" -C "$W" .
$PY - "$W" $SHAPES <<'PYEOF'
import json, os, sys
W, shapes = sys.argv[1], sys.argv[2:]
def load(s, name):
    try:
        d = json.load(open(os.path.join(W, s, name + ".json")))
        return next(iter(d["scenarios"].values())) if "scenarios" in d else d
    except (OSError, ValueError, StopIteration):
        return {}
f = lambda v, fmt="{:,.1f}": fmt.format(v) if isinstance(v, (int, float)) else "-"
print(f"{'shape':14s} {'b1 tok/s':>9s} {'HF b1':>7s} {'x HF':>6s} {'200 streams tok/s':>18s} {'TTFT p50/p99 ms':>16s}")
for s in shapes:
    b1, s2, hf = load(s, "b1"), load(s, "s200"), load(s, "hf")
    z = (b1.get("decode_tokens_per_s") or {}).get("mean")
    h = hf.get("decode_tokens_per_s")
    ttft = s2.get("ttft_ms") or {}
    print(f"{s:14s} {f(z):>9s} {f(h):>7s} {f(z / h if z and h else None, '{:.2f}'):>6s} "
          f"{f(s2.get('output_throughput'), '{:,.0f}'):>18s} {f(ttft.get('p50')) + ' / ' + f(ttft.get('p99')):>16s}"
          + (f"  (HF skipped: {hf['skipped']})" if hf.get("skipped") else ""))
    if s == "mixtral-8x7b":
        print(f"  Mixtral-8x7B batch-1 target >= 115 tok/s: {'met' if z and z >= 115 else 'NOT met'}")
PYEOF
cat "$W/gpu-tests-summary.txt"
