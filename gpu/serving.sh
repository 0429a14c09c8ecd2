#!/usr/bin/env bash
# How fast does zerod serve? Each PART starts `zerod serve` on a dummy-weight model of a
# published shape (Llama-3-8B unless the part says otherwise), drives it through HTTP with
# `zerod bench`, and prints a table against docs/perf.md's targets last. One part fits one
# device call (at most 10 minutes).
#
#   bash gpu/serving.sh [PART] [ARGS...]      results under $OUT
#
# PART (default base):
#   base      TTFT "Hello", batch-1 decode, 200 streams, a 16K prompt, ITL at 16K, ready time
#             (SCENARIOS, SERVE_ARGS, BENCH_ARGS, SHAPE, DEVICE narrow it; see the part)
#   hf        HF transformers on the same shapes (bench/hf_compare.py): the baseline
#   mix       mixed Poisson traffic at 25 and 10 req/s, shared prefixes
#   fp8       bf16 / --quantization fp8 / + --kv-cache-dtype fp8, and HF bf16 batch-1
#   families  the GPU agreement tests per family, then Qwen3-8B, Gemma-2-9B, Mixtral-8x7B shapes
#   lora      8 rank-16 adapters at 200 streams and batch-1, against the base model
#   api       penalties + top-5 logprobs at 200 streams, JSON-schema outputs at 64 streams
#   stalls    the no-stall scenarios from READY on (gpu/stalls_probe.py): the code in .before/
#             (git archive of a reference commit, carried) against this tree, cold and warm starts
#   lora-bursts  8 adapters' first 200-stream burst after READY vs the second, .before/ and this tree
#   throughput  the throughput table (bursts, batch-1, 16K) per shape (8B, 8B FP8, Mixtral-8x7B),
#             .before/ against this tree in alternated pairs of fresh servers
# SMOKE=1 runs most parts on the CPU with tiny shapes (checks the script, measures nothing).
set -u
cd "$(dirname "$0")/.."
PART=${1:-base}; [ $# -gt 0 ] && shift
case "$PART" in
  base|mix|fp8|families|lora|api|stalls|throughput)
    exec bash "gpu/parts/serving_$PART.sh" "$@" ;;
  lora-bursts)
    exec bash gpu/parts/serving_lora_bursts.sh "$@" ;;
  hf)
    OUT=${OUT:-/tmp/zerod-hf}; mkdir -p "$OUT"
    exec timeout 300 "${PYTHON:-python3}" -m zerod.bench.hf_compare --out "$OUT/hf.json" "$@" ;;
  help|-h|--help)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d' ;;
  *)
    sed -n '2,/^set -u/p' "gpu/$(basename "$0")" | sed '$d'; echo "unknown part: $PART" >&2; exit 2 ;;
esac
