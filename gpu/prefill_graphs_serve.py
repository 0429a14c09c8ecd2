"""`zerod serve` under one variant of gpu/prefill_graphs_bench.sh:
    python3 gpu/prefill_graphs_serve.py VARIANT serve ARGS...

shipped:    as shipped (engine/runner/model_runner.py): a step's prompt chunks, up to
            PREFILL_GRAPH_SEQS of them and PREFILL_GRAPH_TOKENS' largest count, are
            prefilled by a CUDA graph whether or not other streams decode;
idle-only:  graphs only for the prompts of an idle engine (steps with decodes prefill
            eager), of any number of chunks, with LoRA rows too;
before:     the rule before 786a8d2: a graph only for a lone chunk that completes its
            prompt, without adapter rows, on an idle engine.
"""

from __future__ import annotations

from serve_variant import serve
from zerod.engine.runner import model_runner


def _idle_only() -> None:
    model_runner.PREFILL_GRAPHS_WHILE_DECODING = False


def _before() -> None:
    _idle_only()
    R = model_runner.ModelRunner
    bucket = R._prefill_bucket

    def lone_base_chunk_only(self, chunks):
        if len(chunks) != 1 or not chunks[0].completes or chunks[0].req.lora_slot:
            return 0
        return bucket(self, chunks)
    R._prefill_bucket = lone_base_chunk_only


if __name__ == "__main__":
    serve("prefill_graphs_serve.py", {"shipped": lambda: None, "idle-only": _idle_only, "before": _before})
