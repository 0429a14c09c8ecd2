"""`zerod serve` with one batch-1 FP8 product (gpu/fp8_m1_bench.sh):
    python3 gpu/fp8_m1_serve.py VARIANT serve ARGS...

shipped:     as shipped (engine/quant/linear.py: M1_TENSORWISE, a one-token step's
             projections through cuBLASLt's tensorwise FP8 GEMM);
w8a16:       M1_TENSORWISE off: through the Triton W8A16 kernel, the rule before 6f7a475;
tensorwise:  M1_TENSORWISE on (what the A/B of a98efc6 called it, shipped off then).
"""

from __future__ import annotations

from serve_variant import serve
from zerod.engine.quant import linear


def _tensorwise(on: bool):
    def apply() -> None:
        linear.M1_TENSORWISE = on
    return apply


if __name__ == "__main__":
    serve("fp8_m1_serve.py", {"shipped": lambda: None, "w8a16": _tensorwise(False), "tensorwise": _tensorwise(True)})
