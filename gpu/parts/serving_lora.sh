#!/usr/bin/env bash
# Multi-LoRA serving on the H200 in one call (~5 min): gpu/lora_kernels_bench.py (the kernels
# alone), the LoRA GPU tests (kernels vs the torch reference, adapters through the decode
# CUDA graphs), then one server (8B shape, dummy base, --enable-lora --max-loras 8, eight
# rank-16 adapters on every projection, written as PEFT files with random weights): 200
# streams (24 in / 128 out, zerod bench --lora-modules) spread over the 8 adapters vs the
# base model alone (target >= 80 %), and batch-1 decode with an adapter vs the base (target
# >= 90 %). Results: $OUT/lora.tgz (with a /metrics scrape after each 200-stream run: the
# step-time histograms run by run); a table last. PLAIN=1 (default) also serves the base
# without --enable-lora (what base rows pay for LoRA being on). TESTS=0 skips the GPU
# tests. SMOKE=1: the same on the CPU with a tiny shape.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-lora}; mkdir -p "$FINAL"
W=/tmp/lora; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh peft xgrammar compressed_tensors   # packages the device image lacks (peft for the tests, psutil), carried in .whl
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 8192 --max-num-seqs 256"
S200="--num-prompts 400 --max-concurrency 200 --input-len 24 --output-len 128 --warmup 200"; B1="--streams 1 --requests 4 --input-len 16 --output-len 256"
# the kernels alone first: per projection, base product vs each decode way's delta (< 1 min)
[ "${KBENCH:-1}" = 1 ] && $PY gpu/lora_kernels_bench.py "$W/kernels.json" 2>&1 | tee "$W/kernels_bench.txt" | tail -12
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 64"
  S200="--num-prompts 16 --max-concurrency 16 --input-len 24 --output-len 8 --warmup 16"; B1="--streams 1 --requests 2 --input-len 16 --output-len 8"
elif [ "${TESTS:-1}" = 1 ]; then
  $PY -m pytest tests/test_lora_kernels.py -q -p no:randomly -p no:cacheprovider 2>&1 | tee "$W/gpu_tests.txt" | tail -3
fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
$PY gpu/lora_bench.py adapters "$M" "$W/adapters" 8 16 || exit 1
MODS=""; for i in 0 1 2 3 4 5 6 7; do MODS="$MODS a$i=$W/adapters/a$i"; done
# shellcheck disable=SC2086
$PY -m zerod serve --model "$M" --served-model-name base --load-format dummy --port 8000 $SERVE_X \
    --gpu-memory-utilization 0.90 --enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules $MODS \
    > "$W/serve.log" 2>&1 &
SPID=$!
[ "$($PY gpu/wait_health.py 8000 300 $SPID)" = ok ] || { tail -20 "$W/serve.log"; kill $SPID; exit 1; }
U=http://127.0.0.1:8000
L="$PY gpu/lora_bench.py load $U"
# the 200-stream runs through zerod bench (client processes enough that the client does not
# bound what it measures; one asyncio process capped the base near 14,500 tokens/s), each
# repetition with its own seed: fresh prompts (one seed for all let later runs hit the prefix
# cache on 16 of 24 tokens). Base and adapters of a repetition share the prompts; the cache
# keys include the adapter, so neither hits the other's.
Z="$PY -m zerod bench --port 8000 --no-progress"
ALL8=a0,a1,a2,a3,a4,a5,a6,a7
# base and adapters alternate, REPS times each (a 200-stream run is ~4 s and moves +-3 points
# run to run): the table takes the medians
for i in $(seq 1 "${REPS:-3}"); do
  # shellcheck disable=SC2086
  timeout 120 $Z --seed "$i" --out "$W/base200-$i.json" --model base $S200 > "$W/base200-$i.txt" 2>&1
  curl -s $U/metrics > "$W/metrics-after-base200-$i.txt"   # step-time histograms run by run
  # shellcheck disable=SC2086
  timeout 120 $Z --seed "$i" --out "$W/lora200-$i.json" --lora-modules $ALL8 $S200 > "$W/lora200-$i.txt" 2>&1
  curl -s $U/metrics > "$W/metrics-after-lora200-$i.txt"
  # shellcheck disable=SC2086
  timeout 120 $L "$W/base1-$i.json" --models base $B1 > "$W/base1-$i.txt" 2>&1
  # shellcheck disable=SC2086
  timeout 120 $L "$W/lora1-$i.json" --models a0 $B1 > "$W/lora1-$i.txt" 2>&1
done
curl -s $U/v1/models > "$W/models.json"
curl -s $U/metrics > "$W/metrics.txt"
kill -TERM $SPID; wait $SPID
# the base model on a server without --enable-lora (PLAIN=1): what base rows pay for LoRA
# being enabled at all
if [ "${PLAIN:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  $PY -m zerod serve --model "$M" --served-model-name base --load-format dummy --port 8000 $SERVE_X \
      --gpu-memory-utilization 0.90 > "$W/serve-plain.log" 2>&1 &
  SPID=$!
  [ "$($PY gpu/wait_health.py 8000 300 $SPID)" = ok ] || { tail -20 "$W/serve-plain.log"; kill $SPID; exit 1; }
  for i in $(seq 1 "${REPS:-3}"); do
    # shellcheck disable=SC2086
    timeout 120 $Z --seed "$i" --out "$W/plain200-$i.json" --model base $S200 > "$W/plain200-$i.txt" 2>&1
    # shellcheck disable=SC2086
    timeout 120 $L "$W/plain1-$i.json" --models base $B1 > "$W/plain1-$i.txt" 2>&1
  done
  kill -TERM $SPID; wait $SPID
fi
tar czf "$FINAL/lora.tgz" -C "$W" --exclude adapters .
$PY - "$W" <<'PYEOF'
import statistics, sys
sys.path.insert(0, "gpu")
from bench_runs import runs as runs_in
W = sys.argv[1]
def runs(name):
    return runs_in(W, name)
for a, b, what, target in (
        ("base200", "lora200", "200 streams over 8 rank-16 adapters", 0.80),
        ("base1", "lora1", "batch-1 decode with an adapter", 0.90),
        ("plain200", "lora200", "200 streams over 8 adapters vs a server without LoRA", 0.80),
        ("plain1", "lora1", "batch-1 with an adapter vs a server without LoRA", 0.90),
        ("plain200", "base200", "200 base streams, LoRA enabled vs not", 1.0),
        ("plain1", "base1", "batch-1 base, LoRA enabled vs not", 1.0)):
    xs, ys = runs(a), runs(b)
    if not xs or not ys:
        print(f"{what}: not measured (see {a}-*.txt / {b}-*.txt)"); continue
    x, y = statistics.median(r["tok_s"] for r in xs), statistics.median(r["tok_s"] for r in ys)
    r = y / x if x else 0.0
    each = ", ".join(f"{q['tok_s']:,.0f}/{p['tok_s']:,.0f}" for p, q in zip(xs, ys))
    print(f"{what}: median {y:,.1f} vs base {x:,.1f} tok/s = {r:.1%} (target >= {target:.0%}: "
          f"{'met' if r >= target else 'NOT met'}); runs (adapter/base) {each}; "
          f"failed {sum(q['failed'] for q in xs + ys)}")
PYEOF
