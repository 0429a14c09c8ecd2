#!/usr/bin/env bash
# The prefill CUDA graphs beside decodes, A/B on the H200 in one call (~8 min): the GPU tests
# of the graph paths, then four servers of the 8B shape (dummy bf16 weights) on the one GPU
# at once (--kv-pages each; the idle ones launch nothing), two rules each
# (gpu/prefill_graphs_serve.py): shipped (a step's prompt chunks prefill from a CUDA graph
# also while streams decode) and OTHER (idle-only: the same only while nothing decodes;
# before: the rule before this change, a graph only for a lone base-model prompt on an idle
# engine):
#   plain-shipped, plain-OTHER   the base model alone
#   lora-shipped, lora-OTHER     --enable-lora --max-loras 8, eight rank-16 adapters on every
#                                projection (PEFT files, random weights)
# REPS rounds, each: 200 streams (24 in / 128 out, zerod bench, fresh prompts per round) on
# every server in turn, the LoRA servers for the base and for the 8 adapters at random; a
# /metrics scrape after each run; then batch-1 decode (base / adapter) on lora-shipped.
# Results: $OUT/prefill_graphs.tgz; a table last. SMOKE=1: the same on the CPU, tiny.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-prefill-graphs}; mkdir -p "$FINAL"
W=/tmp/prefill_graphs; rm -rf "$W"; mkdir -p "$W"
. gpu/wheels.sh peft xgrammar compressed_tensors
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 8192 --max-num-seqs 256 --kv-pages 4000"
S200="--num-prompts 400 --max-concurrency 200 --input-len 24 --output-len 128 --warmup 200"
B1="--streams 1 --requests 4 --input-len 16 --output-len 256"
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 64"
  S200="--num-prompts 16 --max-concurrency 16 --input-len 24 --output-len 8 --warmup 16"
  B1="--streams 1 --requests 2 --input-len 16 --output-len 8"
elif [ "${TESTS:-1}" = 1 ]; then
  timeout 300 $PY -m pytest -q -p no:randomly -p no:cacheprovider -m gpu tests/test_lora_kernels.py \
      tests/test_step_stalls.py tests/test_engine_core.py > "$W/gpu_tests.txt" 2>&1
  echo "gpu tests: $(tail -1 "$W/gpu_tests.txt")"
fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
$PY gpu/lora_bench.py adapters "$M" "$W/adapters" 8 16 || exit 1
MODS=""; for i in 0 1 2 3 4 5 6 7; do MODS="$MODS a$i=$W/adapters/a$i"; done
LORA_X="--enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules $MODS"
O=${OTHER:-idle-only}
SERVERS="plain-shipped plain-$O lora-shipped lora-$O"
declare -A PORT=([plain-shipped]=8000 [plain-$O]=8001 [lora-shipped]=8002 [lora-$O]=8003)
declare -A PID
for s in $SERVERS; do
  rule=${s#*-}
  x=""; case $s in lora-*) x=$LORA_X;; esac
  # shellcheck disable=SC2086
  $PY gpu/prefill_graphs_serve.py "$rule" serve --model "$M" --served-model-name base --load-format dummy \
      --port "${PORT[$s]}" $SERVE_X $x > "$W/serve-$s.log" 2>&1 &
  PID[$s]=$!
  sleep 2
done
for s in $SERVERS; do
  [ "$($PY gpu/wait_health.py "${PORT[$s]}" 400 "${PID[$s]}")" = ok ] || { echo "$s did not start"; tail -20 "$W/serve-$s.log"; }
done
Z="$PY -m zerod bench --no-progress"
ALL8=a0,a1,a2,a3,a4,a5,a6,a7
for i in $(seq 1 "${REPS:-3}"); do
  for s in $SERVERS; do
    p=${PORT[$s]}
    # shellcheck disable=SC2086
    timeout 120 $Z --port "$p" --seed "$i" --out "$W/$s-base200-$i.json" --model base $S200 > "$W/$s-base200-$i.txt" 2>&1
    curl -s "127.0.0.1:$p/metrics" > "$W/metrics-$s-base200-$i.txt"
    case $s in lora-*)
      # shellcheck disable=SC2086
      timeout 120 $Z --port "$p" --seed "$i" --out "$W/$s-lora200-$i.json" --lora-modules $ALL8 $S200 > "$W/$s-lora200-$i.txt" 2>&1
      curl -s "127.0.0.1:$p/metrics" > "$W/metrics-$s-lora200-$i.txt";;
    esac
  done
  L="$PY gpu/lora_bench.py load http://127.0.0.1:${PORT[lora-shipped]}"
  # shellcheck disable=SC2086
  timeout 120 $L "$W/lora-shipped-base1-$i.json" --models base $B1 > "$W/lora-shipped-base1-$i.txt" 2>&1
  # shellcheck disable=SC2086
  timeout 120 $L "$W/lora-shipped-lora1-$i.json" --models a0 $B1 > "$W/lora-shipped-lora1-$i.txt" 2>&1
done
kill -TERM "${PID[@]}"; wait
tar czf "$FINAL/prefill_graphs.tgz" -C "$W" --exclude adapters .
$PY - "$W" "$O" <<'PYEOF'
import statistics, sys
sys.path.insert(0, "gpu")
from bench_runs import runs as runs_in
W, O = sys.argv[1], sys.argv[2]
def runs(name):
    return runs_in(W, name)
def med(rs, k):
    return statistics.median(r[k] for r in rs) if rs else float("nan")
print(f"{'server / traffic':34} {'runs tok/s':>30} {'median':>8} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p95':>8} failed")
rows = {}
for s in ("plain-shipped", f"plain-{O}", "lora-shipped", f"lora-{O}"):
    for t in ("base200", "lora200"):
        rs = runs(f"{s}-{t}")
        if not rs:
            continue
        rows[(s, t)] = med(rs, "tok_s")
        each = ", ".join(f"{r['tok_s']:,.0f}" for r in rs)
        print(f"{s + ' ' + t:34} {each:>30} {rows[(s, t)]:>8,.0f} "
              f"{med(rs, 'ttft99'):>9.0f} {med(rs, 'itl50'):>8.2f} {med(rs, 'itl95'):>8.2f} {sum(r['failed'] for r in rs)}")
def ratio(a, b, what, target=None):
    x, y = rows.get(a), rows.get(b)
    if x and y:
        print(f"{what}: {y / x:.1%}" + (f" (target >= {target:.0%}: {'met' if y / x >= target else 'NOT met'})" if target else ""))
ratio((f"plain-{O}", "base200"), ("plain-shipped", "base200"), f"base 200 streams, shipped vs {O}")
ratio(("lora-shipped", "base200"), ("lora-shipped", "lora200"), "8 adapters vs base, graphs beside decodes", 0.80)
ratio((f"lora-{O}", "base200"), (f"lora-{O}", "lora200"), f"8 adapters vs base, {O}", 0.80)
ratio(("plain-shipped", "base200"), ("lora-shipped", "lora200"), "8 adapters vs a server without LoRA, graphs beside decodes", 0.80)
b, l = runs("lora-shipped-base1"), runs("lora-shipped-lora1")
if b and l:
    print(f"batch-1 with an adapter: {med(l, 'tok_s'):.1f} vs base {med(b, 'tok_s'):.1f} tok/s = "
          f"{med(l, 'tok_s') / med(b, 'tok_s'):.1%} (target >= 90%)")
PYEOF
