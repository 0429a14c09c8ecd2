"""`zerod serve` under one variant of gpu/step_stalls.sh:
    python3 gpu/step_stalls_serve.py VARIANT serve ARGS...

eager-prefix: the rule before this round, a lone prompt with a cached prefix prefilled
              eagerly (~1,000 launches for the 8B shape, each letting go of the GIL);
graph-prefix: as shipped (the padded prefill graph reads the cached prefix);
profiled:     as shipped, sampled by py-spy (gpu/step_stalls.sh starts it): where the step
              thread's CPU goes in its slow launches (the third session showed them the
              thread's own CPU time, not waiting for the GIL).
"""

from __future__ import annotations

import sys

from zerod.engine.model_runner import ModelRunner

VARIANTS = ("eager-prefix", "graph-prefix", "profiled")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in VARIANTS:
        sys.exit(f"usage: step_stalls_serve.py {{{','.join(VARIANTS)}}} serve ARGS...")
    if variant == "eager-prefix":
        bucket = ModelRunner._prefill_bucket
        ModelRunner._prefill_bucket = lambda self, chunks: (
            0 if chunks and chunks[0].start else bucket(self, chunks))
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()


if __name__ == "__main__":
    main()
