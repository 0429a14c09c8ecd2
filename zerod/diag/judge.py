"""The verdict on a measured figure against the spec figure.

A healthy GPU reaches a fixed share of its datasheet figure with these simple
kernels (a copy, one large GEMM): below `WARN_RATIO` of it warns, below
`FAIL_RATIO` fails (such a GPU is throttled, mis-linked or sick). Correctness
comes first: a wrong result fails however fast it was.
"""

from __future__ import annotations

WARN_RATIO = 0.6
FAIL_RATIO = 0.35


def verdict(measured: float, expected: float | None) -> str:
    """pass, warn or fail; pass when there is nothing to hold the figure against."""
    if not expected:
        return "pass"
    ratio = measured / expected
    if ratio < FAIL_RATIO:
        return "fail"
    if ratio < WARN_RATIO:
        return "warn"
    return "pass"


def describe(what: str, measured: float, expected: float | None, unit: str) -> str:
    if not expected:
        return f"{what}: {measured:,.1f} {unit} (no spec figure for this GPU model)"
    return (f"{what}: {measured:,.1f} {unit}, {100 * measured / expected:.0f} % of the spec "
            f"{expected:,.0f} {unit} (warn below {WARN_RATIO:.0%}, fail below {FAIL_RATIO:.0%})")
