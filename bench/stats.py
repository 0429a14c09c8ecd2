"""Latency statistics: percentiles as numpy computes them, summaries in milliseconds."""

from __future__ import annotations

import math


def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_vals:
        return float("nan")
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summary_ms(vals_s: list[float]) -> dict[str, float | int | None]:
    """mean / p50 / p95 / p99 / min / max in milliseconds, and the count."""
    if not vals_s:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "min": None,
                "max": None}
    v = sorted(x * 1000.0 for x in vals_s)
    return {"n": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50),
            "p95": percentile(v, 95), "p99": percentile(v, 99), "min": v[0], "max": v[-1]}
