"""`zerod serve` under one variant of gpu/prefill_graphs_bench.sh:
    python3 gpu/prefill_graphs_serve.py VARIANT serve ARGS...

shipped:    as shipped (engine/model_runner.py): a step's prompt chunks, up to
            PREFILL_GRAPH_SEQS of them and PREFILL_GRAPH_TOKENS' largest count, are
            prefilled by a CUDA graph whether or not other streams decode;
idle-only:  the rule before, graphs only for the prompts of an idle engine (steps with
            decodes prefill eager).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout, uninstalled
from zerod.engine import model_runner  # noqa: E402

VARIANTS = ("shipped", "idle-only")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in VARIANTS:
        sys.exit(f"usage: prefill_graphs_serve.py {{{','.join(VARIANTS)}}} serve ARGS...")
    if variant == "idle-only":
        model_runner.PREFILL_GRAPHS_WHILE_DECODING = False
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()


if __name__ == "__main__":
    main()
