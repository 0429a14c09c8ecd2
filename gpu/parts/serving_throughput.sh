#!/usr/bin/env bash
# bash gpu/serving.sh throughput: the throughput issue's figures through HTTP, the tree in
# .before/ (git archive of the reference commit, carried) against this tree. For each shape
# of SHAPES (default "8b mixtral-8x7b"; also 8b-fp8: --quantization fp8) each variant of
# VARIANTS (default "before after after2 before2": alternated pairs, a fresh server each,
# names ending in 2 run their tree again; ARGS_<name> adds serve flags to a variant, e.g.
# ARGS_split=--engine-process with VARIANTS="after split split2 after2") serves dummy weights and `zerod bench --scenario
# throughput-table` drives it: two 200-stream bursts (24 in / 128 out), the same 200 as
# closed-loop users, batch-1 decode, a 16K prompt. TUNING_<name> sets a variant's ZEROD_TUNING
# (engine/tuning.py), e.g. TUNING_fast='{"fp8_fast_accum": true}'. Mixtral-8x7B's 93 GB of weights need the H200's memory. ~1 min a server.
# Results: $OUT/throughput.tgz (each server's log, step trace and bench output, packed as
# each ends), a table last. SMOKE=1: the script on the CPU, a tiny shape (checks it, measures nothing).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUTD=${OUT:-/tmp/zerod-throughput}; mkdir -p "$OUTD"
W=/tmp/zerod-throughput-work; rm -rf "$W"; mkdir -p "$W"
. gpu/parts/wheels.sh xgrammar psutil
export PYTHONUNBUFFERED=1
ROOT=$PWD
SHAPES=${SHAPES:-8b mixtral-8x7b}
VARIANTS=${VARIANTS:-before after after2 before2}
SERVE_X="--dtype bfloat16 --max-model-len 17408 --max-num-seqs 256 --gpu-memory-utilization 0.90"
BENCH_X=${BENCH_X:-}
if [ "${SMOKE:-0}" = 1 ]; then
    SHAPES=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 16 --kv-cache-memory-bytes 64MiB"
    BENCH_X="--num-prompts 4 --output-len 4 --input-len 8 $BENCH_X"
fi
pack() { tar czf "$OUTD/throughput.tgz" -C "$W" .; }
git log --oneline -1 > "$W/commit.txt" 2>/dev/null
for shape in $SHAPES; do
    M=/tmp/zerod-dummy-${shape%-fp8}
    case $shape in
        mixtral-8x7b) $PY gpu/families_model.py "$M" --shape "$shape" > /dev/null || exit 1 ;;
        *) $PY gpu/server_make_model.py "$M" --shape "${shape%-fp8}" > /dev/null || exit 1 ;;
    esac
    extra=""; [ "${shape%-fp8}" != "$shape" ] && extra="--quantization fp8"
    for v in $VARIANTS; do
        dir=$ROOT; [ "${v%2}" = before ] && dir=$ROOT/.before
        name=$shape-$v
        vargs=ARGS_${v%2}; vargs=${!vargs:-}
        vtuning=TUNING_${v%2}; vtuning=${!vtuning:-}
        t0=$(date +%s.%N)
        # each tree its own Triton cache, warm from its first server on
        ( cd "$dir" && ZEROD_TUNING=$vtuning TRITON_CACHE_DIR=/tmp/triton-${v%2} ZEROD_STEP_TRACE=$W/steps-$name.jsonl \
            exec $PY -m zerod serve --model "$M" --load-format dummy \
            --port 8000 $SERVE_X $extra $vargs ) > "$W/serve-$name.log" 2>&1 &
        SPID=$!
        if [ "$($PY gpu/wait_health.py 8000 300 $SPID)" != ok ]; then
            tail -5 "$W/serve-$name.log"; kill $SPID 2>/dev/null; pack; continue
        fi
        echo "$name ready_s $(awk "BEGIN{print $(date +%s.%N) - $t0}")" | tee -a "$W/ready.txt"
        # shellcheck disable=SC2086
        timeout 240 $PY -m zerod bench --port 8000 --scenario throughput-table --no-progress $BENCH_X \
            --out "$W/bench-$name.json" > "$W/bench-$name.txt" 2>&1
        curl -s http://127.0.0.1:8000/metrics > "$W/metrics-$name.txt"
        kill -TERM $SPID; wait $SPID 2>/dev/null
        pack
    done
done
echo "== $(cat "$W/commit.txt" 2>/dev/null), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
for f in "$W"/bench-*.txt; do
    echo "-- $(basename "$f" .txt)"; grep -E "^(throughput-table:|hello-ttft )" "$f" | sed "s/^throughput-table://"
done
