"""`zerod serve` with one batch-1 FP8 product (gpu/fp8_m1_bench.sh):
    python3 gpu/fp8_m1_serve.py VARIANT serve ARGS...

shipped:     as shipped (engine/quant/linear.py): a one-token step's projections through
             the Triton W8A16 kernel;
tensorwise:  M1_TENSORWISE on: through cuBLASLt's tensorwise FP8 GEMM (the token's
             activation scale is tensor-wide), the per-channel scales after.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout, uninstalled
from zerod.engine.quant import linear  # noqa: E402

VARIANTS = ("shipped", "tensorwise")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in VARIANTS:
        sys.exit(f"usage: fp8_m1_serve.py {{{','.join(VARIANTS)}}} serve ARGS...")
    linear.M1_TENSORWISE = variant == "tensorwise"
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()


if __name__ == "__main__":
    main()
