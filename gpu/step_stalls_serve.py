"""`zerod serve` under one variant of gpu/step_stalls.sh:
    python3 gpu/step_stalls_serve.py VARIANT serve ARGS...

cudnn-every-length: the rule before, fresh prompts' SDPA through the default backend
                    (cuDNN's on the H200) at their own lengths: a plan built per new length;
shipped:            as shipped (engine/model.py: the plan-free backends up to
                    SDPA_FLASH_MAX_LEN, the default above with lengths padded to buckets);
profiled:           as shipped, sampled by py-spy (gpu/step_stalls.sh starts it): where the
                    step thread's CPU goes in what slow launches are left.
Every variant logs launches over 30 ms (the engine's own threshold is 100 ms): a plan
build is ~42 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout, uninstalled
from zerod.engine import engine, model  # noqa: E402

VARIANTS = ("cudnn-every-length", "shipped", "profiled")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in VARIANTS:
        sys.exit(f"usage: step_stalls_serve.py {{{','.join(VARIANTS)}}} serve ARGS...")
    engine.SLOW_LAUNCH_S = 0.03
    if variant == "cudnn-every-length":
        model.SDPA_FLASH_MAX_LEN = 0
        model.SDPA_PAD_LENGTHS = False
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()


if __name__ == "__main__":
    main()
