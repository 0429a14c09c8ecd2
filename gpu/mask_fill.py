"""The step thread's structured-output work per step, on the CPU: `python gpu/mask_fill.py`.
It drives engine internals, so it stands with the device tools, outside the product.

64 rows decode under gpu/api_bench.sh's JSON schema through the engine's own
grammar_mask.MaskStaging (plan, fill, launched), with the tokens a random-weight model
picks: uniform over each row's mask. A row whose output is whole is replaced by a fresh
request, as a 64-stream benchmark keeps 64 in flight. Timed per step, as CPU seconds of
the process (xgrammar's fill threads included) and as wall time:
- advance: the matchers take the last step's tokens (xgrammar batch_accept_token);
- fill:    xgrammar's batch bitmask fill (its thread pool);
- rest:    the rest of structured.fill_masks (terminated rows; before 2026-12-01 also
           the JSON control-character rule ANDed into every row);
- stage:   MaskStaging.plan + fill + launched in all (the three above, the copy, the lists).
Tokenizers: `demo` is gpu/server_make_model.py's 8B model directory (the demo tokenizer's
384 entries in a 128,256-id vocabulary); `128k` is gpu/big_tokenizer.py's 128,256-entry
tokenizer (a Llama-3-sized vocabulary), read from --big (made there when missing).
Compare with the plain step's host time (gpu/step_host.py) and the H200's decode step at
64 streams (about 6.5 ms; docs/perf.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zerod from the checkout

import torch

# gpu/api_bench.sh's SCHEMA
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
          "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}},
          "required": ["name", "tags", "score"], "additionalProperties": False}
MODEL_VOCAB = 128256   # the 8B shape's (gpu/server_make_model.py)
_BIG = Path(__file__).resolve().parent.parent / ".models" / "bigtok"


class _Row:
    """What MaskStaging reads of a request."""

    def __init__(self, grammar) -> None:
        self.grammar, self.released = grammar, False


class _Timer:
    """Per-step totals of named parts: process CPU seconds and wall seconds."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        c, w = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            with self.part(name):
                return fn(*a, **kw)
        return timed


def _tokenizer(which: str, big: Path):
    from zerod.engine.tokenizer import Tokenizer

    if which == "demo":
        from zerod.engine.demo import write_tokenizer
        d = tempfile.mkdtemp(prefix="mask-fill-")
        write_tokenizer(Path(d))
        return Tokenizer(d)
    if not (big / "tokenizer.json").exists():
        print(f"making the 128k tokenizer in {big} (gpu/big_tokenizer.py, about a minute)", file=sys.stderr)
        script = Path(__file__).resolve().parent.parent / "gpu" / "big_tokenizer.py"
        subprocess.run([sys.executable, str(script), str(big)], check=True, stdout=subprocess.DEVNULL)
    return Tokenizer(big)


def _pick(masks: torch.Tensor, vocab: int, gen: torch.Generator) -> list[int]:
    """One token per mask row, uniform over the allowed ones (random logits under the mask)."""
    from zerod.engine.sampling.grammar_mask import apply_bitmask

    n = masks.shape[0]
    logits = apply_bitmask(torch.rand(n, vocab, generator=gen), torch.arange(n), masks)
    return logits.argmax(1).tolist()


def run(which: str, rows: int = 64, steps: int = 128, threads: int | None = None,
        big: Path = _BIG, seed: int = 0) -> dict:
    from zerod.engine.sampling import grammar_mask, structured
    from zerod.engine.sampling.structured import GrammarCompiler, GrammarSpec

    import xgrammar as xgr

    engine_batch = structured._batch
    if threads is not None:   # every fill on a pool of that size
        pool = xgr.BatchGrammarMatcher(max_threads=threads)
        structured._batch = lambda rows: pool
    comp = GrammarCompiler(_tokenizer(which, big), MODEL_VOCAB)
    compiled = comp.compile(GrammarSpec("json", json.dumps(SCHEMA)))
    staging = grammar_mask.MaskStaging(2, rows, torch.device("cpu"))
    t = _Timer()
    cls = xgr.BatchGrammarMatcher
    real = (grammar_mask.advance_all, grammar_mask.fill_masks, cls.batch_fill_next_token_bitmask)
    grammar_mask.advance_all = t.wrap("advance", real[0])
    grammar_mask.fill_masks = t.wrap("fill_masks", real[1])
    cls.batch_fill_next_token_bitmask = t.wrap("fill", real[2])
    gen = torch.Generator().manual_seed(seed)
    reqs = [_Row(comp.new_state(compiled)) for _ in range(rows)]
    per_step: list[dict[str, float]] = []
    done = 0
    try:
        for k in range(steps + 2):
            t.cpu.clear()
            t.wall.clear()
            with t.part("stage"):
                _, masked = staging.plan([reqs], lambda idx: torch.tensor(idx))
                staging.fill(k % 2, masked)
            ids = torch.tensor(_pick(staging.dev[:len(masked)], MODEL_VOCAB, gen), dtype=torch.int64)
            with t.part("stage"):
                staging.launched(ids, list(enumerate(masked)))
            if k >= 2:   # the first steps have no tokens to take
                per_step.append({**{f"{p}_cpu": s for p, s in t.cpu.items()},
                                 **{f"{p}_wall": s for p, s in t.wall.items()}})
            for i, r in enumerate(reqs):   # a whole output ends its request: a new one takes the row
                if r.grammar.terminated:
                    r.released, done = True, done + 1
                    reqs[i] = _Row(comp.new_state(compiled))
        if staging.broken:
            raise AssertionError("a picked token broke its grammar")
    finally:
        grammar_mask.advance_all, grammar_mask.fill_masks = real[0], real[1]
        cls.batch_fill_next_token_bitmask = real[2]
        structured._batch = engine_batch
    med = {k: statistics.median(s.get(k, 0.0) for s in per_step) * 1e3 for k in per_step[0]}
    med["rest_cpu"] = med["fill_masks_cpu"] - med["fill_cpu"]
    med["rest_wall"] = med["fill_masks_wall"] - med["fill_wall"]
    return {"tokenizer": which, "rows": rows, "steps": len(per_step), "threads": threads,
            "outputs_whole": done, "ms": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--tokenizer", choices=("demo", "128k"), action="append")
    ap.add_argument("--threads", type=int, action="append",
                    help="xgrammar fill threads (repeatable); default: the engine's choice "
                         "(one thread up to structured.POOL_ROWS rows)")
    ap.add_argument("--big", type=Path, default=_BIG, help="the 128k tokenizer's directory")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{a.rows} rows of gpu/api_bench.sh's JSON schema, {a.steps} steps; ms per step "
          f"(median), CPU of the process / wall; H200 plain decode step at 64 streams ~6.5 ms")
    print(f"{'tokenizer':9} {'threads':>7} {'advance':>13} {'fill':>13} {'rest':>13} "
          f"{'stage (all)':>13} {'per row us':>10}")
    for which in a.tokenizer or ["demo", "128k"]:
        for th in a.threads or [None]:
            r = run(which, a.rows, a.steps, th, a.big)
            m = r["ms"]

            def cell(p):
                return f"{m[p + '_cpu']:6.2f}/{m[p + '_wall']:6.2f}"
            print(f"{which:9} {th if th is not None else 'engine':>7} {cell('advance'):>13} "
                  f"{cell('fill'):>13} {cell('rest'):>13} {cell('stage'):>13} "
                  f"{m['stage_wall'] * 1e3 / a.rows:10.1f}")


if __name__ == "__main__":
    main()
