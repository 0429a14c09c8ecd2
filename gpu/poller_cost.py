"""The output poller's host time per token, on this machine's CPU: what a 200-stream step
costs the poller thread (which shares the GIL with the step thread that launches the
next step).

    python3 gpu/poller_cost.py [--tokenizer DIR] [--rows 200] [--steps 400]

It runs the engine's OutputPoller on a host ring filled with random ids of the
tokenizer's vocabulary, one StepRecord a step, with the engine's real metrics and a
callback that keeps each output (the server's own callback is not part of it). The
tokenizer defaults to the demo model's; `gpu/big_tokenizer.py DIR` writes one with a
Llama-3-sized vocabulary whose every id decodes to text. Prints the median µs a token
over five rounds, and the same with the metrics' observations alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zerod from the checkout

import torch  # noqa: E402

from zerod.engine.core.output import HostRing, OutputPoller, StepRecord  # noqa: E402
from zerod.engine.core.request import Request, SamplingParams  # noqa: E402
from zerod.engine.metrics import EngineMetrics  # noqa: E402
from zerod.engine.tokenizer import Tokenizer  # noqa: E402


def run(tok: Tokenizer, rows: int, steps: int, seed: int) -> float:
    """Seconds of poller work a token: `steps` decode steps of `rows` streams."""
    rng = random.Random(seed)
    ring = HostRing(2, rows, torch.device("cpu"))
    metrics = EngineMetrics(lambda: {}, "bench")
    poller = OutputPoller(tok, ring, metrics, notify_stop=lambda r: None, on_stream_error=lambda e: None)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    kept: list = []
    reqs = [Request(f"r{i}", [1, 2, 3], params, kept.append, steps + 1, seed=i) for i in range(rows)]
    vocab = tok.vocab_size
    ids = torch.randint(0, vocab, (steps, rows), generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    for s in range(steps):
        slot = ring.free.get()
        ring.tokens[slot, :rows] = ids[s]
        now = time.perf_counter()
        poller._step(StepRecord(slot, reqs, now, now, 0, rows))
        if len(kept) > 10_000:
            kept.clear()
    return (time.perf_counter() - t0) / (steps * rows)


def metrics_only(rows: int, steps: int) -> float:
    """Seconds a token of the inter-token gap's metrics alone, fed as the poller feeds them."""
    metrics = EngineMetrics(lambda: {}, "bench")
    gaps = [0.012] * rows
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics.itl.observe_many(gaps)
        metrics.max_itl.observe(max(gaps))
    return (time.perf_counter() - t0) / (steps * rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the demo model's)")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    if a.tokenizer:
        path = Path(a.tokenizer)
    else:
        from zerod.engine.demo import demo_model_dir
        path = demo_model_dir()
    tok = Tokenizer(path)
    per = [run(tok, a.rows, a.steps, seed) for seed in range(5)]
    met = [metrics_only(a.rows, a.steps) for _ in range(5)]
    print(f"tokenizer {path} ({tok.vocab_size} ids), "
          f"{a.rows} rows x {a.steps} steps, 5 rounds")
    print(f"poller, a token: median {statistics.median(per) * 1e6:.2f} µs "
          f"(rounds {', '.join(f'{p * 1e6:.2f}' for p in per)})")
    print(f"of which the inter-token gap's metrics: median {statistics.median(met) * 1e6:.2f} µs")
    print(f"at 20,000 tokens/s: {statistics.median(per) * 20_000:.3f} cores")


if __name__ == "__main__":
    main()
