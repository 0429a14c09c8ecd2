#!/usr/bin/env bash
# bash gpu/serving.sh lora-bursts: the first burst after READY on a LoRA server vs the next (issue 31's
# "8 adapters, first burst vs second", target within 5 %), the code in .before/ and this tree in one call,
# each on a fresh Triton cache: 8B shape (dummy bf16), --enable-lora --max-loras 8, eight rank-16
# adapters on every projection; then 200 streams (24 in / 128 out, no warm-up requests) spread over the
# 8 adapters twice, then the base model twice. ~3 min. Results: $OUT/lora_bursts.tgz, a table last.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-lora-bursts}; mkdir -p "$FINAL"
W=/tmp/lora-bursts; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh xgrammar
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
$PY gpu/lora_bench.py adapters "$M" "$W/adapters" 8 16 || exit 1
MODS=""; for i in 0 1 2 3 4 5 6 7; do MODS="$MODS a$i=$W/adapters/a$i"; done
ROOT=$PWD
Z="$PY -m zerod bench --port 8000 --no-progress --num-prompts 200 --max-concurrency 200 --input-len 24 --output-len 128 --warmup 0"
for v in ${VARIANTS:-before after}; do
    dir=$ROOT; [ $v = before ] && dir=$ROOT/.before
    # shellcheck disable=SC2086
    ( cd "$dir" && TRITON_CACHE_DIR=/tmp/triton-lora-$v exec $PY -m zerod serve --model "$M" --served-model-name base \
        --load-format dummy --port 8000 --dtype bfloat16 --max-model-len 8192 --max-num-seqs 256 \
        --gpu-memory-utilization 0.90 --enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules $MODS ) \
        > "$W/serve-$v.log" 2>&1 &
    SPID=$!
    [ "$($PY gpu/wait_health.py 8000 300 $SPID)" = ok ] || { tail -20 "$W/serve-$v.log"; kill $SPID; continue; }
    # shellcheck disable=SC2086
    timeout 120 $Z --seed 11 --out "$W/$v-lora1.json" --lora-modules a0,a1,a2,a3,a4,a5,a6,a7 > "$W/$v-lora1.txt" 2>&1
    timeout 120 $Z --seed 12 --out "$W/$v-lora2.json" --lora-modules a0,a1,a2,a3,a4,a5,a6,a7 > "$W/$v-lora2.txt" 2>&1
    timeout 120 $Z --seed 13 --out "$W/$v-base1.json" --model base > "$W/$v-base1.txt" 2>&1
    timeout 120 $Z --seed 14 --out "$W/$v-base2.json" --model base > "$W/$v-base2.txt" 2>&1
    kill -TERM $SPID; wait $SPID 2>/dev/null
done
gzip -f "$W"/serve-*.log
$PY - "$W" <<'PYEOF' | tee "$W/table.txt"
import json, os, sys
w = sys.argv[1]
def tps(v, r):
    p = os.path.join(w, f"{v}-{r}.json")
    if not os.path.exists(p):
        return None
    d = next(iter(json.load(open(p))["scenarios"].values()))
    return d.get("output_throughput")
print("| code | adapters, burst 1 | burst 2 | base, burst 1 / 2 | burst 1 vs 2 | burst 1 / 2 of base (best) |")
print("|---|---|---|---|---|---|")
for v in ("before", "after"):
    l1, l2, b1, b2 = (tps(v, r) for r in ("lora1", "lora2", "base1", "base2"))
    if None in (l1, l2, b1, b2):
        print(f"| {v} | {l1} | {l2} | {b1} / {b2} | - | - |"); continue
    b = max(b1, b2)
    print(f"| {v} | {l1:,.0f} | {l2:,.0f} | {b1:,.0f} / {b2:,.0f} | {100 * (l1 / l2 - 1):+.1f} % | {100 * l1 / b:.0f} / {100 * l2 / b:.0f} % |")
PYEOF
tar czf "$FINAL/lora_bursts.tgz" -C "$W" --exclude adapters .
