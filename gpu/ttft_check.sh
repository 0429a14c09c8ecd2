#!/usr/bin/env bash
# After the lone-prompt prefill graphs: the engine's GPU tests (agreement with
# transformers goes through the padded graph path for lone prompts), then the HTTP
# scenarios the change should move (hello-ttft) or must not hurt (decode-b1, streams-200).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/zerod-final}; W=/tmp/ev2; rm -rf "$W"; mkdir -p "$W"
git rev-parse HEAD > "$W/commit.txt" 2>/dev/null
[ -n "${SKIP_TESTS:-}" ] || timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py > "$W/gpu-tests.txt" 2>&1
echo "rc $?" >> "$W/gpu-tests.txt"
OUT=$W READY_TIMEOUT=90 SCENARIOS=${SCENARIOS:-"hello-ttft streams-200 decode-b1"} timeout 170 bash gpu/server_bench.sh > "$W/server-console.txt" 2>&1
echo "rc $?" >> "$W/server-console.txt"
grep -i "graph" "$W/server/serve.log" | head -5
tar czf "$FINAL/ttft.tgz" -C "$W" .
tail -4 "$W/gpu-tests.txt"; tail -22 "$W/server-console.txt"
