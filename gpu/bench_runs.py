"""The runs a device script's closing table reads, from its work folder: zerod bench's JSON
(the 200-stream runs) and gpu/lora_bench.py load's (batch-1), in one shape:
tok_s (output tokens/s of the run; for batch-1, the decode rate per request), failed, and
for zerod bench's runs ttft99, itl50, itl95 (ms)."""

from __future__ import annotations

import glob
import json
import os


def runs(folder: str, name: str) -> list[dict]:
    """Every repetition NAME-<i>.json under folder, in file-name order (unreadable ones skipped)."""
    out = []
    for f in sorted(glob.glob(os.path.join(folder, name + "-[0-9]*.json"))):
        try:
            doc = json.load(open(f))
        except (OSError, ValueError):
            continue
        if "scenarios" in doc:   # zerod bench's
            r = doc["scenarios"]["random"]
            out.append({"tok_s": r["output_throughput"], "failed": r["failed"], "ttft99": r["ttft_ms"]["p99"],
                        "itl50": r["itl_ms"]["p50"], "itl95": r["itl_ms"].get("p95", float("nan"))})
        else:
            out.append({"tok_s": doc["decode_tok_s_per_request"], "failed": doc.get("failed", 0)})
    return out
