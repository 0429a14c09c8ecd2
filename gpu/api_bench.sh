#!/usr/bin/env bash
# Issue 13's H200 figures in one call (~3 min): 200 streams (24 in / 128 out) plain vs with
# presence, frequency and repetition penalties and top-5 logprobs (target >= 85 % of plain);
# 64 streams (64 in / 128 out) plain vs with a JSON schema (vLLM's structured_outputs json on
# /v1/completions; target overhead <= 10 %; the masks are computed on the CPU while the GPU runs
# each step's forward, docs/engine-server.md "Structured outputs"), the schema part skipped when
# the server refuses the field; each line ends with the step thread's cores in both parts.
# Results: $OUT/api.tgz; a table last. SMOKE=1: the same on the CPU with a tiny shape.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-api}; mkdir -p "$FINAL"
W=/tmp/api; rm -rf "$W"; mkdir -p "$W"
. gpu/wheels.sh xgrammar   # xgrammar (structured outputs) and psutil, carried in .whl
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 8192 --max-num-seqs 256"; SMALL=""
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 64"
  SMALL="--num-prompts 8 --output-len 8 --warmup 1"
fi
M=/tmp/zerod-dummy-$SHAPE
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
# shellcheck disable=SC2086
$PY -m zerod serve --model "$M" --load-format dummy --port 8000 $SERVE_X --gpu-memory-utilization 0.90 \
    > "$W/serve.log" 2>&1 &
SPID=$!
for _ in $(seq 1 600); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break; sleep 0.25; done
B="$PY -m zerod bench --port 8000 --no-progress"
PEN='{"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logprobs": 5}'
SCHEMA='{"ignore_eos": false, "structured_outputs": {"json": {"type": "object", "properties": {"name": {"type": "string"},
  "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}, "required": ["name", "tags", "score"],
  "additionalProperties": false}}}'
# shellcheck disable=SC2086
timeout 90 $B --scenario streams-200 $SMALL --out "$W/plain200.json" > "$W/plain200.txt" 2>&1
# shellcheck disable=SC2086
timeout 90 $B --scenario streams-200 $SMALL --extra-body "$PEN" --out "$W/pen200.json" > "$W/pen200.txt" 2>&1
S64="--input-len 64 --output-len 128 --max-concurrency 64 --num-prompts 192 --warmup 16"
# shellcheck disable=SC2086
timeout 90 $B $S64 $SMALL --extra-body '{"ignore_eos": false}' --out "$W/plain64.json" > "$W/plain64.txt" 2>&1
if curl -sf -o /dev/null -H 'content-type: application/json' http://127.0.0.1:8000/v1/completions \
     -d "{\"prompt\": \"x\", \"max_tokens\": 4, $(echo "$SCHEMA" | sed 's/^{//; s/}$//')}"; then
  # shellcheck disable=SC2086
  timeout 120 $B $S64 $SMALL --extra-body "$SCHEMA" --out "$W/schema64.json" > "$W/schema64.txt" 2>&1
else
  echo "the server refuses response_format json_schema: the structured-output part is skipped" | tee "$W/schema64.txt"
fi
curl -s http://127.0.0.1:8000/metrics > "$W/metrics.txt"
kill -TERM $SPID; wait $SPID
tar czf "$FINAL/api.tgz" -C "$W" .
$PY - "$W" <<'PYEOF'
import json, os, sys
W = sys.argv[1]
def s(name):
    try:
        d = json.load(open(os.path.join(W, name + ".json")))["scenarios"]
        return next(iter(d.values()))
    except (OSError, ValueError, StopIteration):
        return None
def step(x):
    c = ((x.get("engine_cpu") or {}).get("threads_cores") or {}).get("zerod-step")
    return "?" if c is None else f"{c:.2f}"
for a, b, what, target in (("plain200", "pen200", "200 streams, penalties + top-5 logprobs", ">= 85 %"),
                           ("plain64", "schema64", "64 streams, JSON schema", "overhead <= 10 %")):
    x, y = s(a), s(b)
    if not x or not y:
        print(f"{what}: not measured"); continue
    r = y["output_throughput"] / x["output_throughput"]
    print(f"{what}: {y['output_throughput']:,.0f} vs plain {x['output_throughput']:,.0f} output tokens/s = {r:.1%} "
          f"(target {target}); TTFT p50 {y['ttft_ms']['p50']:.1f} vs {x['ttft_ms']['p50']:.1f} ms; "
          f"failed {y['failed']}/{y['num_requests']}; step thread {step(y)} vs {step(x)} cores")
PYEOF
