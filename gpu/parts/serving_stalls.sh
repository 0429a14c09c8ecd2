#!/usr/bin/env bash
# The step thread's slow launches under fresh prompts (H200, ~2 min): a dummy Llama-3-8B
# server, 128 closed-loop streams of fresh prompts whose lengths are drawn log-uniform from
# 32-1024 tokens (random ids: no prefix-cache hits), 256 output tokens, so prompts of many
# lengths are prefilled beside running decodes. The engine logs every launch over 100 ms,
# split into staging, the step thread's CPU, garbage collection and waiting (GIL, device or
# a core); the table sums them beside the bench's tokens/s, TTFT p99 and ITL p99.
# Results: $OUT/step_stalls.tgz (serve log, bench JSON, metrics); the table last.
# SMOKE=1: the CPU, tiny.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-step-stalls}; mkdir -p "$FINAL"
W=/tmp/step_stalls; rm -rf "$W"; mkdir -p "$W"
pack() { tar czf "$FINAL/step_stalls.tgz" -C "$W" .; }
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 8192 --max-num-seqs 256"; LOAD_S=${LOAD_S:-60}
STREAMS=128; OUTLEN=256
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 64"
  LOAD_S=${LOAD_S:-10}; STREAMS=16; OUTLEN=32
fi
. gpu/parts/wheels.sh psutil   # packages the device image lacks, carried in .whl
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
V=shipped
# shellcheck disable=SC2086
$PY -m zerod serve --model "$M" --load-format dummy --port 8000 $SERVE_X \
    --gpu-memory-utilization 0.90 > "$W/serve-$V.log" 2>&1 &
SPID=$!
if [ "$($PY gpu/wait_health.py 8000 150 $SPID)" != ok ]; then
  echo "the server did not start:"; tail -30 "$W/serve-$V.log"; kill $SPID 2>/dev/null; exit 1
fi
timeout -k 5 -s INT "$LOAD_S" $PY -m zerod bench --port 8000 --no-progress --input-len-range 32:1024 \
    --output-len $OUTLEN --max-concurrency $STREAMS --num-prompts $((STREAMS * 8)) \
    --seed 1 --out "$W/bench-$V.json" > "$W/bench-$V.txt" 2>&1
curl -s http://127.0.0.1:8000/metrics > "$W/metrics-$V.txt"
kill -TERM $SPID; wait $SPID
pack
$PY - "$W" <<'PYEOF'
import json, os, re, statistics, sys
W = sys.argv[1]
pat = re.compile(r"took (\d+) ms to launch \((\d+) prompt chunks, (\d+) tokens, (\d+) decodes; staging ([\d.]+) ms, "
                 r"step thread on CPU (\d+) ms, garbage collection (\d+) ms, waiting \(GIL, device or a core\) (\d+) ms"
                 r"(?:; (\d+) earlier steps unfinished)?")
print(f"{'variant':18s} {'slow':>5s} {'p50 ms':>7s} {'max ms':>7s} {'cpu':>6s} {'gc':>6s} {'waited':>7s} "
      f"{'lone 0-decode':>13s} {'behind':>6s} {'tok/s':>8s} {'TTFT p99':>9s} {'ITL p99':>8s}")
for v in ("shipped",):
    rows = [tuple(float(x or 0) for x in m.groups()) for m in map(pat.search, open(os.path.join(W, f"serve-{v}.log")))
            if m]
    rows = rows[1:] if rows and rows[0][0] > 300 else rows   # a first-step compile is another story
    try:
        s = next(iter(json.load(open(os.path.join(W, f"bench-{v}.json")))["scenarios"].values()))
        tail = f"{s['output_throughput']:8.0f} {s['ttft_ms']['p99']:9.1f} {s['itl_ms']['p99']:8.1f}"
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        tail = "   bench: no result"
    wall = [r[0] for r in rows]
    tot = lambda i: sum(r[i] for r in rows)
    lone = sum(1 for r in rows if r[1] == 1 and r[3] == 0)
    print(f"{v:18s} {len(rows):5d} {statistics.median(wall) if wall else 0:7.0f} {max(wall, default=0):7.0f} "
          f"{tot(5):6.0f} {tot(6):6.0f} {tot(7):7.0f} {lone:13d} {sum(r[8] > 0 for r in rows):6d} {tail}")
print("slow: launches over 100 ms; cpu / gc / waited: their ms summed (step thread CPU, garbage collection,"
      " waiting for the GIL, the device or a core); lone 0-decode: slow launches of one prompt chunk alone;"
      " behind: slow launches made while earlier steps were unfinished on the device")
PYEOF
