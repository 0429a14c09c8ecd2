#!/usr/bin/env bash
# FP8 serving on the H200 in one call (~6 min): the FP8 GEMMs alone at the 8B shapes
# (gpu/fp8_gemm_bench.py: which product wins at which M), the FP8 GPU tests, then the
# Llama-3-8B shape with dummy weights through HTTP, three servers in turn:
#   bf16     --dtype bfloat16                                  (the baseline of the same call)
#   fp8      --quantization fp8  (e4m3 weights per channel, activations per token)
#   fp8+kv   --quantization fp8 --kv-cache-dtype fp8
# each: batch-1 decode tok/s, 200 streams (24 in / 128 out) tok/s with TTFT p50/p99, a 16K
# prompt's time to first token, and the KV pool's size as 4K-token sequences that fit.
# Then HF transformers bf16 batch-1 decode on the same GPU (bench/hf_compare.py).
# Results: $OUT/fp8.tgz; a table last. SMOKE=1: the same on the CPU with a tiny shape.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-fp8}; mkdir -p "$FINAL"
W=$(mktemp -d /tmp/fp8.XXXXXX)   # the raw output, tarred into $FINAL
. gpu/parts/wheels.sh compressed_tensors   # reads the FP8 checkpoints' quantization_config (tests)
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 17408 --max-num-seqs 256 --gpu-memory-utilization 0.90"
SMALL=""; SC16K="prefill-16k"
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 4608 --max-num-seqs 32 --kv-cache-memory-bytes 64MiB"
  SMALL="--num-prompts 4 --output-len 8 --warmup 1 --max-concurrency 4"; SC16K=""
fi
{
  echo "date: $(date -u +%FT%TZ) commit: $(git rev-parse HEAD 2>/dev/null) shape: $SHAPE"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$W/env.txt" 2>&1

# 0. the GEMMs alone: bf16 / W8A8 / W8A16 per M, and the thresholds they imply (checks first)
OUT="$W" timeout ${GEMM_TIMEOUT:-180} $PY gpu/fp8_gemm_bench.py > "$W/fp8_gemm.txt" 2>&1
echo "gemm bench: $(grep -E '^implied|^FAILED' "$W/fp8_gemm.txt" || tail -1 "$W/fp8_gemm.txt")"

# 1. correctness first: the FP8 kernels and FP8 checkpoints on the GPU (skipped on the CPU)
timeout 240 $PY -m pytest -q -p no:randomly -m gpu tests/test_fp8_kernels.py tests/test_fp8_checkpoints.py \
    > "$W/gpu-tests.txt" 2>&1
echo "gpu tests: $(tail -1 "$W/gpu-tests.txt")"

M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
B="$PY -m zerod bench --port 8000 --no-progress"

run_variant() {   # name, extra serve flags
  local name=$1; shift
  # shellcheck disable=SC2086
  $PY -m zerod serve --model "$M" --load-format dummy --port 8000 $SERVE_X "$@" > "$W/$name-serve.log" 2>&1 &
  local spid=$!
  for _ in $(seq 1 720); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break
    kill -0 $spid 2>/dev/null || break; sleep 0.25; done
  if ! curl -sf -o /dev/null http://127.0.0.1:8000/health; then
    echo "$name: the server did not start"; tail -20 "$W/$name-serve.log"; kill -9 $spid 2>/dev/null; return
  fi
  # shellcheck disable=SC2086
  timeout 60 $B --scenario decode-b1 $SMALL --out "$W/$name-b1.json" > "$W/$name-b1.txt" 2>&1
  # shellcheck disable=SC2086
  timeout 90 $B --scenario streams-200 $SMALL --out "$W/$name-200.json" > "$W/$name-200.txt" 2>&1
  if [ -n "$SC16K" ]; then
    timeout 60 $B --scenario "$SC16K" --out "$W/$name-16k.json" > "$W/$name-16k.txt" 2>&1
  fi
  curl -s http://127.0.0.1:8000/metrics > "$W/$name-metrics.txt"
  kill -TERM $spid; wait $spid
}
# VARIANTS / HF=0 trim a call that has little device time left (the table marks what did not run)
VARIANTS=${VARIANTS:-bf16 fp8 fp8kv}
case " $VARIANTS " in *" bf16 "*) run_variant bf16;; esac
case " $VARIANTS " in *" fp8 "*) run_variant fp8 --quantization fp8;; esac
case " $VARIANTS " in *" fp8kv "*) run_variant fp8kv --quantization fp8 --kv-cache-dtype fp8;; esac
if [ "${SMOKE:-0}" != 1 ] && [ "${HF:-1}" = 1 ]; then
  timeout 120 $PY -m zerod.bench.hf_compare --scenarios decode-b1 --out "$W/hf.json" > "$W/hf.txt" 2>&1
fi
tar czf "$FINAL/fp8.tgz" -C "$W" .

$PY - "$W" <<'PYEOF'
import json, os, re, sys
W = sys.argv[1]
def s(name):
    try:
        return next(iter(json.load(open(os.path.join(W, name + ".json")))["scenarios"].values()))
    except (OSError, ValueError, StopIteration, KeyError):
        return None
def seqs_4k(name):
    try:
        log = open(os.path.join(W, name + "-serve.log")).read()
    except OSError:
        return None
    m = re.search(r"(\d+) KV pages of (\d+) tokens", log)
    return int(m.group(1)) * int(m.group(2)) // 4096 if m else None
def hf_b1():
    try:
        d = json.load(open(os.path.join(W, "hf.json")))
        r = d.get("decode-b1") or d.get("scenarios", {}).get("decode-b1") or {}
        return r.get("output_throughput") or r.get("tokens_per_s")
    except (OSError, ValueError, AttributeError):
        return None
print(f"{'variant':8} {'b1 tok/s':>9} {'200 tok/s':>10} {'TTFT p50':>9} {'p99 ms':>7} {'16K TTFT':>9} {'4K seqs':>8}")
for v in ("bf16", "fp8", "fp8kv"):
    b1, st, pf = s(v + "-b1"), s(v + "-200"), s(v + "-16k")
    f = lambda x, k: f"{x[k]:,.0f}" if x else "-"
    ttft = lambda x, q: f"{x['ttft_ms'][q]:.0f}" if x else "-"
    print(f"{v:8} {f(b1, 'output_throughput'):>9} {f(st, 'output_throughput'):>10} {ttft(st, 'p50'):>9} "
          f"{ttft(st, 'p99'):>7} {ttft(pf, 'p50'):>9} {seqs_4k(v) or '-':>8}")
print(f"HF transformers bf16 batch-1 decode: {hf_b1() or '-'} tok/s")
try:
    gemm = open(os.path.join(W, "fp8_gemm.txt"), errors="replace").read().splitlines()
except OSError:
    gemm = []
print("FP8 GEMMs, us per layer (qkv+o+gate_up+down), from fp8_gemm.txt:")
for line in gemm:
    if line.startswith(("  M=", "implied", "FAILED")):
        print(line)
print("targets (FP8, H200): b1 >= 420, 200 streams >= 30,000 with TTFT p99 <= 150 ms, 16K TTFT <= 300 ms")
PYEOF
