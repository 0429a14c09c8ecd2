#!/usr/bin/env bash
# The device's tuned kernel tables (engine/kernels/skinny_configs/, moe_configs/) against the
# engine without them, in one device call (~8 min; the most wanted first, packed as it goes):
#   1. the skinny, table and FP8 GPU tests;
#   2. the 8B shape, --quantization fp8, a server without the skinny table and one with it
#      (ZEROD_TUNING={"skinny_gemm_table": true}): `zerod bench` decode-b1, streams-200 and
#      8, 32 and 64 concurrent streams through HTTP (a second round of both last);
#   3. the Mixtral-8x7B shape in-process with the MoE table: gpu/decode_profile.py's
#      200-request wave (kernels by name, per step);
#   4. cuBLAS and the first skinny config at every row count 128..256 in steps of 8 (the
#      decode graph buckets' neighbourhood; gpu/skinny_gemm_bench.py).
# PARTS (default "tests fp8 mixtral msweep fp8-2") picks some of them. TUNING_OFF and
# TUNING_ON (ZEROD_TUNING objects) replace the two FP8 servers' tunings, to compare others.
# Results: $OUT/tables.tgz (every log and JSON), a table last.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTD=${OUT:-/tmp/zerod-tables}; mkdir -p "$OUTD"
W=/tmp/zerod-tables-work; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh xgrammar
export PYTHONUNBUFFERED=1
pack() { tar czf "$OUTD/tables.tgz" -C "$W" .; }
git log --oneline -1 > "$W/commit.txt" 2>/dev/null
# the kernels' GPU tests, the FP8 ones with the H200 table in force
want() { [[ " ${PARTS:-tests fp8 mixtral msweep fp8-2} " == *" $1 "* ]]; }
want tests && timeout 100 $PY -m pytest -m gpu -q -p no:cacheprovider -p no:randomly tests/test_skinny_gemm.py tests/test_gemm_table.py \
    tests/test_fp8_kernels.py > "$W/gpu_tests.txt" 2>&1; tail -3 "$W/gpu_tests.txt" 2>/dev/null
pack
M=/tmp/zerod-dummy-8b
$PY gpu/server_make_model.py "$M" --shape 8b > /dev/null || exit 1
fp8_round() {   # fp8_round N: a server without the skinny table, then one with it
    for v in off on; do
        tuning=${TUNING_OFF:-'{"skinny_gemm_table": false}'}; [ $v = on ] && tuning=${TUNING_ON:-'{"skinny_gemm_table": true}'}
        ZEROD_TUNING=$tuning TRITON_CACHE_DIR=/tmp/triton-fp8 $PY -m zerod serve --model "$M" --load-format dummy \
            --port 8000 --dtype bfloat16 --quantization fp8 --max-model-len 4096 --max-num-seqs 256 \
            > "$W/serve-fp8-$v-$1.log" 2>&1 &
        SPID=$!
        [ "$($PY gpu/wait_health.py 8000 240 $SPID)" = ok ] || { tail -5 "$W/serve-fp8-$v-$1.log"; kill $SPID; continue; }
        for sc in decode-b1 streams-200; do
            timeout 120 $PY -m zerod bench --port 8000 --scenario $sc --no-progress \
                --out "$W/bench-fp8-$v-$1-$sc.json" > "$W/bench-fp8-$v-$1-$sc.txt" 2>&1
        done
        for n in 8 32 64; do   # decode steps of 8-64 rows: the table's W8A16 and row-wise cells
            timeout 120 $PY -m zerod bench --port 8000 --scenario streams-200 --max-concurrency $n \
                --num-prompts $((4 * n)) --warmup $n --no-progress \
                --out "$W/bench-fp8-$v-$1-streams-$n.json" > "$W/bench-fp8-$v-$1-streams-$n.txt" 2>&1
        done
        kill -TERM $SPID; wait $SPID 2>/dev/null
        pack
    done
}
want fp8 && fp8_round 1
MX=/tmp/zerod-dummy-mixtral
want mixtral && $PY gpu/families_model.py "$MX" --shape mixtral-8x7b > /dev/null && timeout 200 $PY gpu/decode_profile.py "$MX" "$W/mixtral-profile.json" --max-model-len 4096 --windows wave \
    > "$W/mixtral-profile.txt" 2>&1
pack
want msweep && timeout 100 $PY gpu/skinny_gemm_bench.py --max-configs 1 --ms "$(seq -s, 128 8 256)" \
    --out "$W/msweep.json" > "$W/msweep.txt" 2>&1
pack
want fp8-2 && fp8_round 2
echo "== row counts 128..256: cuBLAS us per shape"; grep -E "^(bf16|fp8) +(qkv|o|gate_up|down) " "$W/msweep.txt" | awk '{print $1, $2, $4, $5}' | sort -k1,1 -k2,2 -k3n | paste -sd' ' | fold -w 200
echo "== FP8 8B, skinny table off / on"; grep -h -E "decode-b1|streams-200" "$W"/bench-fp8-*.txt | head -20
for f in "$W"/bench-fp8-*.txt; do echo "$(basename $f): $(grep -E '^(decode-b1|streams-200) ' $f | head -1)"; done
echo "== Mixtral wave"; tail -30 "$W/mixtral-profile.txt"
