#!/usr/bin/env bash
# Issue 13's H200 figures in one call (~3 min): 200 streams (24 in / 128 out) plain vs with
# presence, frequency and repetition penalties and top-5 logprobs (target >= 85 % of plain);
# 64 streams (64 in / 128 out) plain vs with a JSON schema (vLLM's structured_outputs json on
# /v1/completions; target overhead <= 10 %; the masks are computed on the CPU while the GPU runs
# each step's forward, docs/engine-server.md "Structured outputs"), the schema part skipped when
# the server refuses the field; each line ends with the step thread's cores in both parts.
# The 64-stream pair runs on a second server whose tokenizer has 128,256 entries
# (gpu/big_tokenizer.py; .models/bigtok when carried, else made here, ~30 s): the demo
# tokenizer's 384 entries would make the masks look cheap. Then, on the host CPU alone,
# gpu/mask_fill.py's parts of the mask work per step by xgrammar thread count (mask_fill.txt).
# Results: $OUT/api.tgz; a table last. SMOKE=1: the same on the CPU with a tiny shape.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FINAL=${OUT:-/tmp/zerod-api}; mkdir -p "$FINAL"
W=/tmp/api; rm -rf "$W"; mkdir -p "$W"
. gpu/wheels.sh xgrammar   # xgrammar (structured outputs) and psutil, carried in .whl
SHAPE=8b; SERVE_X="--dtype bfloat16 --max-model-len 8192 --max-num-seqs 256"; SMALL=""; MASK_X="--steps 64"
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=tiny; SERVE_X="--dtype float32 --device cpu --max-model-len 1024 --max-num-seqs 64"
  SMALL="--num-prompts 8 --output-len 8 --warmup 1"; MASK_X="--steps 4"
fi
M=/tmp/zerod-dummy-$SHAPE
MB=/tmp/zerod-dummy-$SHAPE-bigtok
$PY gpu/server_make_model.py "$M" --shape $SHAPE > /dev/null || exit 1
$PY gpu/server_make_model.py "$MB" --shape $SHAPE > /dev/null || exit 1
if [ -f .models/bigtok/tokenizer.json ]; then
  cp .models/bigtok/tokenizer.json .models/bigtok/tokenizer_config.json "$MB"/ || exit 1
else
  $PY gpu/big_tokenizer.py "$MB" > /dev/null || exit 1
fi
$PY - "$MB" <<'PYEOF' || exit 1
import json, sys
from tokenizers import Tokenizer
d = sys.argv[1]
t = Tokenizer.from_file(f"{d}/tokenizer.json")
c = json.load(open(f"{d}/config.json"))
c["bos_token_id"], c["eos_token_id"] = t.token_to_id("<|begin_of_text|>"), t.token_to_id("<|end_of_text|>")
c["vocab_size"] = max(c["vocab_size"], t.get_vocab_size())
json.dump(c, open(f"{d}/config.json", "w"), indent=1)
PYEOF
serve() {  # serve MODEL_DIR LOG: start zerod serve (pid in SPID), wait for /health
  # shellcheck disable=SC2086
  $PY -m zerod serve --model "$1" --load-format dummy --port 8000 $SERVE_X --gpu-memory-utilization 0.90 \
      > "$2" 2>&1 &
  SPID=$!
  for _ in $(seq 1 600); do curl -sf -o /dev/null http://127.0.0.1:8000/health && break; sleep 0.25; done
}
B="$PY -m zerod bench --port 8000 --no-progress"
PEN='{"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logprobs": 5}'
SCHEMA='{"ignore_eos": false, "structured_outputs": {"json": {"type": "object", "properties": {"name": {"type": "string"},
  "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}, "required": ["name", "tags", "score"],
  "additionalProperties": false}}}'
# PENALTIES=0 / MASK_FILL=0 trim a call with little device time left to the structured pair
if [ "${PENALTIES:-1}" = 1 ]; then
  serve "$M" "$W/serve.log"
  # shellcheck disable=SC2086
  timeout 90 $B --scenario streams-200 $SMALL --out "$W/plain200.json" > "$W/plain200.txt" 2>&1
  # shellcheck disable=SC2086
  timeout 90 $B --scenario streams-200 $SMALL --extra-body "$PEN" --out "$W/pen200.json" > "$W/pen200.txt" 2>&1
  curl -s http://127.0.0.1:8000/metrics > "$W/metrics200.txt"
  kill -TERM $SPID; wait $SPID
fi
serve "$MB" "$W/serve-bigtok.log"
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
# the mask work's parts on this host's CPU (no server running): one thread vs xgrammar's pool
# shellcheck disable=SC2086
[ "${MASK_FILL:-1}" = 1 ] && { timeout 120 $PY gpu/mask_fill.py --tokenizer 128k --big "$MB" $MASK_X --threads 1 --threads 4 --threads 8
  timeout 60 $PY gpu/mask_fill.py --tokenizer 128k --big "$MB" $MASK_X --rows 256 --threads 1 --threads 8
} > "$W/mask_fill.txt" 2>&1
grep -v Warning "$W/mask_fill.txt"
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
