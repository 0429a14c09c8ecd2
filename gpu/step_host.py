"""The step thread's host time per decode step, on the CPU: `python gpu/step_host.py`.
It drives engine internals, so it stands with the device tools, outside the product.

200 plain requests decode together on the demo model's runner, whose forward is replaced by
a stub (fixed hidden states and logits), so what is timed is the host side of a step as the
step thread runs it: scheduling, staging the inputs, and the launch's Python and torch
dispatch (on the GPU the kernels run asynchronously; here the tiny tensor ops run inline).
`--mix` gives every 50th request a penalty, a logit_bias, logprobs, min_p and min_tokens, to
show what the per-feature work costs once some request uses it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zerod from the checkout


class _StubModel:
    """The runner's model with no compute: hidden states and logits of the right shapes."""

    def __init__(self, model, vocab: int, rows: int):
        self.ops = model.ops
        self.dtype = model.dtype
        self.cos_sin = model.cos_sin
        self._hidden = torch.zeros(4096, 8)
        self._logits = torch.randn(rows, vocab)

    def __call__(self, tokens, positions, kv, meta, layers=None):
        return self._hidden[:tokens.shape[0]]

    def logits(self, hidden):
        return self._logits[:hidden.shape[0]]


def run(n: int = 200, steps: int = 300, mix: bool = False) -> dict:
    from zerod.engine.core.engine import Engine, EngineConfig
    from zerod.engine.core.request import Request, SamplingParams
    from zerod.engine.sampling.sampler import row_class

    eng = Engine(EngineConfig(model="demo", device="cpu", max_model_len=1024, kv_pages=4096,
                              max_num_seqs=n, seed=0))
    runner, sched = eng.runner, eng.scheduler
    runner.model = stub = _StubModel(runner.model, eng.vocab_size, n)
    # a decode is a graph replay on the GPU (fixed host cost): skip the CPU path's eager
    # forward and its width scan, which the GPU does not run
    runner._decode_logits = lambda B, slots, pos, reqs: stub.logits(stub._hidden[:B])
    for i in range(n):
        # greedy: random sampling's noise is device compute, which would swamp the host time
        p = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        if mix and i % 50 == 0:
            p = SamplingParams(max_tokens=steps + 8, temperature=1.0, ignore_eos=True,
                               presence_penalty=0.5, logit_bias={5: 1.0}, logprobs=2,
                               min_p=0.05, min_tokens=2)
        r = Request(f"r{i}", [5 + i % 50, 6, 7, 8], p, lambda o: None, p.max_tokens, i,
                    sample_class=row_class(p.temperature, p.top_k, p.top_p, p.min_p))
        sched.claim_wait_place()
        sched.add(r)
    times = []
    depth = runner.ring.tokens.shape[0]
    for k in range(steps + 1):
        t0 = time.perf_counter()
        batch = sched.schedule()
        runner.step(k % depth, batch)
        sched.update(batch)
        times.append(time.perf_counter() - t0)
        if k == 0:
            assert not batch.decodes and len(batch.chunks) == n, "expected one prefill step"
            times.clear()
    return {"requests": n, "steps": len(times), "mix": mix,
            "median_us": statistics.median(times) * 1e6,
            "p10_us": sorted(times)[len(times) // 10] * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for mix in (False, True):
        runs = [run(a.requests, a.steps, mix) for _ in range(a.repeats)]
        med = statistics.median(r["median_us"] for r in runs)
        p10 = statistics.median(r["p10_us"] for r in runs)
        print(f"{a.requests} decoding requests, {'1 in 50 with every feature' if mix else 'plain'}: "
              f"host time per step median {med:.0f} us (p10 {p10:.0f} us; median of {a.repeats} "
              f"runs of {a.steps} steps)")


if __name__ == "__main__":
    main()
