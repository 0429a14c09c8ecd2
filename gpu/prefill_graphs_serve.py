"""`zerod serve` under one variant of gpu/prefill_graphs_bench.sh:
    python3 gpu/prefill_graphs_serve.py VARIANT serve ARGS...

shipped:    as shipped (engine/model_runner.py): a step's prompt chunks, up to
            PREFILL_GRAPH_SEQS of them and PREFILL_GRAPH_TOKENS' largest count, are
            prefilled by a CUDA graph whether or not other streams decode;
idle-only:  graphs only for the prompts of an idle engine (steps with decodes prefill
            eager), of any number of chunks, with LoRA rows too;
before:     the rule before 786a8d2: a graph only for a lone chunk that completes its
            prompt, without adapter rows, on an idle engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout, uninstalled
from zerod.engine import model_runner  # noqa: E402

VARIANTS = ("shipped", "idle-only", "before")


def _lone_base_chunk_only(bucket):
    def rule(self, chunks):
        if len(chunks) != 1 or not chunks[0].completes or chunks[0].req.lora_slot:
            return 0
        return bucket(self, chunks)
    return rule


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in VARIANTS:
        sys.exit(f"usage: prefill_graphs_serve.py {{{','.join(VARIANTS)}}} serve ARGS...")
    if variant in ("idle-only", "before"):
        model_runner.PREFILL_GRAPHS_WHILE_DECODING = False
    if variant == "before":
        R = model_runner.ModelRunner
        R._prefill_bucket = _lone_base_chunk_only(R._prefill_bucket)
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()


if __name__ == "__main__":
    main()
