"""The engine's scheduler under the H200's step costs, on the CPU: a discrete-event model of
the no-stall scenarios, for choosing what to try in a device call (not a measurement).

    python3 gpu/schedule_sim.py [--scenarios burst200,mix25,mix10,prefix,streams16k] [--seeds 3]
                                [--variants current,one-forward,...] [--json OUT]

The real `Scheduler` (admission, prefix cache, the chunk budget and its `StepCost` line)
decides every step; only the device is modelled. A step's time is the `Cost` below, whose
constants come from H200 figures recorded in this repository (docs/perf.md "A decode step
against its bounds", "Prefill CUDA graphs"; gpu/results/serving.md): a forward of M rows
costs the weights' read plus M times the measured per-row cost, decode attention its
rows' context, prompt attention its (query, key) pairs; prompt chunks pad to the prefill
graphs' token counts and decode rows to the decode graphs' batch sizes. Steps run one
after another; a token reaches its client when its step ends (the HTTP path's ~1.4 ms and
the host's launch overlap are left out). The traffic is `gpu/stalls_probe.py`'s.

`--fit TRACE` replaces the model's device constants by a least-squares fit to a
`ZEROD_STEP_TRACE` file (engine/core/step_trace.py: every step's shape and device time)
recorded on the device, e.g. during `gpu/serving.sh stalls`.

`--check` compares the model of `current` (two forwards a step) with the H200's recorded
figures for the same scenarios (gpu/results/serving.md, "No stall from READY on") before the variants
are read: a model that misses them says nothing about the variants.

Variants (each changes one thing against `current`; `a+b` applies both):
  current        a step with prompt chunks runs a prefill forward and then the decode
                 forward (the weights read twice): the loop the H200 traces of --check
                 recorded, and the engine with Tuning.one_forward_mixed_steps off
  one-forward    prompt chunks and decode rows in one forward (the weights read once):
                 the engine as it is (one_forward_mixed_steps on by default)
  itl35, itl40   --target-itl-ms 35 / 40 (the ITL p99 target is 40 ms)
  budget4k       --max-num-batched-tokens 4096
  ttft-slack0    a long prompt's deadline is target_ttft alone, not plus its own prefill
  graph-seqs-256 prefill graphs that hold 256 chunks (a burst's step stays in a graph)
  batch-before-slot  each batch formed before waiting for its ring slot, 4 slots (the loop
                 the four-slot recordings ran: a batch sees arrivals up to 5 steps before it runs)
  no-lag         each batch formed as the step before it ends (the device never queued)
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import random
import statistics
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zerod from the checkout

import torch  # noqa: E402

from zerod.engine.config import EngineConfig  # noqa: E402
from zerod.engine.core import scheduler as scheduler_mod  # noqa: E402
from zerod.engine.core.kv_pool import KVPool  # noqa: E402
from zerod.engine.core.request import Request, SamplingParams  # noqa: E402
from zerod.engine.core.step_trace import step_shape  # noqa: E402
from zerod.engine.runner.decode_sizes import graph_buckets  # noqa: E402
from zerod.engine.runner.graphs import prefill_graph_for, prefill_graph_sizes, prefill_graph_slots  # noqa: E402
from zerod.engine.spec.hf_config import parse_model_config  # noqa: E402
from zerod.engine.tuning import Tuning  # noqa: E402

# The pool's bookkeeping only: one tiny layer (the sizes of the 8B run are its page counts).
_MC = parse_model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 1,
                          "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 32})
PAGES_8B = 52941              # the stalls run's pool (`--max-model-len 17408 --max-num-seqs 256`)


@dataclass(frozen=True)
class Cost:
    """Seconds of an 8B bf16 step on the H200, from recorded figures."""
    weights_s: float = 4.5e-3        # a forward's fixed part: batch-1 step 4.81 ms, of it GEMMs 4.02
    per_row_s: float = 17.8e-6       # (a 2,040-token chunk's 41 ms - 4.5) / 2,040; 200 rows: 8.2 + attention
    decode_attn_s: float = 0.2e-3    # decode attention's launches
    per_ctx_token_s: float = 0.06e-6  # 200 rows x 88 tokens of context: 1.03 ms
    per_pair_s: float = 0.92e-9      # prompt attention per (query, key) pair: the 16K prompt's 123 ms
    one_forward: bool = False        # chunks and decode rows in one forward
    # The step thread's launch of an eager prefill (chunks beyond a prefill graph): a
    # 2,040-token chunk 12.7 ms; 161 and 197 chunks of ~24 tokens 102 and 104 ms (the H200's
    # slow-launch log lines). The device cannot finish the step before its launch has.
    eager_host_s: float = 12.2e-3
    eager_host_per_chunk_s: float = 0.47e-3

    def step(self, chunk_rows: int, pairs: float, decode_rows: int, context: int) -> float:
        pre = (self.weights_s + self.per_row_s * chunk_rows + self.per_pair_s * pairs) if chunk_rows else 0.0
        dec = (self.weights_s + self.per_row_s * decode_rows + self.decode_attn_s
               + self.per_ctx_token_s * context) if decode_rows else 0.0
        if self.one_forward and chunk_rows and decode_rows:
            return pre + dec - self.weights_s
        return pre + dec


def fit_cost(path: str) -> tuple[Cost, float, int]:
    """Cost's device constants fitted (least squares) to a ZEROD_STEP_TRACE file: (the
    cost, the median relative error of the fit over its steps, the steps). A trace whose
    steps record their forwards' rows is fitted on those (one forward a step or two); an
    older one's rows are padded as Graphs pads them, which models two forwards only."""
    import numpy as np

    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    if not lines or lines[0].get("trace") != "zerod-steps":
        raise ValueError(f"{path}: not a ZEROD_STEP_TRACE file (its first line is the header)")
    head, steps = lines[0], [x for x in lines[1:] if x.get("device_ms", 0) > 0]
    recorded = all("rows" in x for x in steps)
    if head["tuning"].get("one_forward_mixed_steps") and not recorded:
        raise ValueError(f"{path}: a trace of one forward a step without its forwards' rows; "
                         "the fit pads rows for two forwards only")
    if len(steps) < 10:
        raise ValueError(f"{path}: {len(steps)} steps, too few to fit five constants")
    tuning = Tuning(**{k: tuple(v) if isinstance(v, list) else v for k, v in head["tuning"].items()})
    graphs = Graphs(tuning, head["max_num_batched_tokens"], head["max_model_len"], head["max_num_seqs"])
    rows = []
    for x in steps:
        if recorded:
            chunk_rows, dec = x["rows"]
        else:
            chunk_rows = graphs.prompt_rows(x["prompt_tokens"], x["chunks"]) if x["chunks"] else 0
            dec = graphs.decode_rows(x["decodes"]) if x["decodes"] else 0
        rows.append([(chunk_rows > 0) + (dec > 0), chunk_rows + dec, x["decodes"] > 0,
                     x["context"], x["pairs"]])
    a, y = np.array(rows, dtype=float), np.array([x["device_ms"] / 1000 for x in steps])
    coef = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0.0, None)
    err = float(np.median(np.abs(a @ coef - y) / y))
    return Cost(weights_s=coef[0], per_row_s=coef[1], decode_attn_s=coef[2], per_ctx_token_s=coef[3],
                per_pair_s=coef[4]), err, len(steps)


@dataclass(frozen=True)
class Graphs:
    """The rows a step's forwards run, padded as the runner pads them (graphs.py's sizes)."""
    tuning: Tuning
    budget: int            # --max-num-batched-tokens
    max_model_len: int
    max_num_seqs: int

    @functools.cached_property
    def prompt_slots(self) -> dict[int, int]:
        """Each prefill graph's token count and chunk slots, as the runner captures them."""
        return prefill_graph_slots(self.tuning, prefill_graph_sizes(self.tuning, self.budget, self.max_model_len),
                                   self.max_num_seqs)

    def prompt_rows(self, tokens: int, chunks: int) -> int:
        """The prefill graph's token count for these chunks (ModelRunner._prefill_bucket);
        the tokens themselves where none holds them (eager)."""
        return prefill_graph_for(self.prompt_slots, tokens, chunks) or tokens

    def decode_rows(self, rows: int) -> int:
        buckets = graph_buckets(self.max_num_seqs)
        return buckets[bisect.bisect_left(buckets, rows)] if rows <= buckets[-1] else rows


class _Clock:
    """The scheduler's time.monotonic(), moved by the simulation."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@dataclass
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int
    tag: str = ""


def loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def poisson(rng: random.Random, rate: float, seconds: float, start: float, make) -> list[Arrival]:
    out, t = [], start
    while t < start + seconds:
        prompt, n = make()
        out.append(Arrival(t, prompt, n))
        t += rng.expovariate(rate)
    return out


def traffic(name: str, seed: int) -> list[Arrival]:
    """gpu/stalls_probe.py's phases as arrival lists (token ids drawn as it draws them)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 128256) for _ in range(n)]

    if name in ("mix25", "mix10"):
        rate, secs = (25.0, 40.0) if name == "mix25" else (10.0, 30.0)
        return poisson(rng, rate, secs, 0.0, lambda: (prompt(loguniform(rng, 32, 4096)), loguniform(rng, 16, 512)))
    if name == "prefix":
        prefixes = [prompt(2000) for _ in range(16)]
        return poisson(rng, 16.0, 20.0, 0.0, lambda: (rng.choice(prefixes) + prompt(48), 64))
    if name == "burst200":
        # zerod bench's streams-200 wave: the server's handlers start over ~90 ms (the H200's
        # access log of `serving.sh lora-bursts`: 78-100 ms for 200 requests)
        return sorted((Arrival(rng.uniform(0.0, 0.09), prompt(24), 128) for _ in range(200)), key=lambda a: a.at)
    if name == "streams16k":
        out = [Arrival(0.0, prompt(64), 700, "stream") for _ in range(32)]
        return out + [Arrival(3.0, prompt(16384), 1, "big")]
    raise SystemExit(f"unknown scenario {name}")


@dataclass(frozen=True)
class Variant:
    cfg: tuple = ()                  # EngineConfig fields changed, as (name, value) pairs
    cost: Cost = Cost()              # --fit replaces its device constants
    tuning: Tuning = Tuning()
    # steps between a batch's forming and its start on the device: the engine forms step k
    # when step k - lag has ended (a ring slot frees), lag = Tuning.steps_in_flight (None);
    # a loop with 4 slots that forms each batch before waiting for its slot has lag 5
    lag: int | None = None


# What each variant name changes; "a+b" applies both.
CHANGES = {
    "current": lambda v: v,
    "one-forward": lambda v: replace(v, cost=replace(v.cost, one_forward=True)),
    "itl35": lambda v: replace(v, cfg=v.cfg + (("target_itl_ms", 35.0),)),
    "itl40": lambda v: replace(v, cfg=v.cfg + (("target_itl_ms", 40.0),)),
    "budget4k": lambda v: replace(v, cfg=v.cfg + (("max_num_batched_tokens", 4096),)),
    "ttft-slack0": lambda v: replace(v, tuning=replace(v.tuning, long_prompt_slack=0.0)),
    "graph-seqs-256": lambda v: replace(v, tuning=replace(v.tuning, prefill_graph_seqs=256)),
    "graph-seqs-32": lambda v: replace(v, tuning=replace(v.tuning, prefill_graph_chunk_tokens=0)),
    "batch-before-slot": lambda v: replace(v, lag=5),
    "no-lag": lambda v: replace(v, lag=1),
}


def variant(name: str, cost: Cost | None = None) -> Variant:
    v = Variant() if cost is None else Variant(cost=cost)
    for part in name.split("+"):
        if part not in CHANGES:
            raise ValueError(f"unknown variant {part!r}; known: {', '.join(CHANGES)} (joined with +)")
        v = CHANGES[part](v)
    return v


def simulate(arrivals: list[Arrival], v: Variant) -> dict:
    """Every request's first-token time and token gaps, run to completion."""
    clock = _Clock()
    saved_time = scheduler_mod.time
    scheduler_mod.time = types.SimpleNamespace(monotonic=clock.monotonic)
    try:
        return _run(arrivals, v, clock)
    finally:
        scheduler_mod.time = saved_time


def _run(arrivals: list[Arrival], v: Variant, clock: _Clock) -> dict:
    cfg = EngineConfig(block_size=16, max_num_seqs=256, max_model_len=17408, **dict(v.cfg))
    graphs = Graphs(v.tuning, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs)
    sched = scheduler_mod.Scheduler(cfg, KVPool(_MC, PAGES_8B, 16, torch.float16, torch.device("cpu")),
                                    tuning=v.tuning)
    pending = sorted(arrivals, key=lambda a: a.at)
    tags, first, last, gaps, nxt = {}, {}, {}, {}, 0
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    lag = v.lag or v.tuning.steps_in_flight
    ends: list[float] = []   # the device's step end times
    while nxt < len(pending) or sched.has_work:
        # what the step loop had seen when it formed this batch: arrivals up to the end of the
        # step `lag` back (an idle device forms it as a request arrives)
        seen = ends[-lag] if sched.has_work and len(ends) >= lag and ends[-1] >= clock.now else clock.now
        while nxt < len(pending) and pending[nxt].at <= seen:
            a = pending[nxt]
            r = Request(f"r{nxt}", a.prompt, replace(params, max_tokens=a.max_tokens), lambda o: None,
                        a.max_tokens, seed=nxt, arrival=a.at)
            tags[r.id] = (a.tag, a.at)
            sched.claim_wait_place()
            sched.add(r)
            nxt += 1
        batch = sched.schedule()
        if not len(batch):
            if nxt >= len(pending):
                break
            clock.now = max(clock.now, pending[nxt].at)
            continue
        x = step_shape(batch, clock.now)   # what ZEROD_STEP_TRACE records of a step
        tokens = x["prompt_tokens"]
        rows = graphs.prompt_rows(tokens, x["chunks"]) if x["chunks"] else 0
        dt = v.cost.step(rows, x["pairs"], graphs.decode_rows(x["decodes"]) if x["decodes"] else 0, x["context"])
        if x["chunks"] and rows == tokens:   # no graph holds the chunks: an eager launch
            dt = max(dt, v.cost.eager_host_s + v.cost.eager_host_per_chunk_s * x["chunks"])
        clock.now += dt
        ends.append(clock.now)
        sched.cost.observe(tokens, len(batch.decodes), dt)
        done = [c.req for c in batch.chunks if c.completes] + list(batch.decodes)
        sched.update(batch)
        for r in done:
            if r.id not in first:
                first[r.id] = clock.now
            else:
                gaps.setdefault(r.id, []).append(clock.now - last[r.id])
            last[r.id] = clock.now
    return {"tags": tags, "first": first, "gaps": gaps}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary(name: str, run: dict) -> dict:
    tags, first, gaps = run["tags"], run["first"], run["gaps"]
    ttft = {rid: (first[rid] - at) * 1000 for rid, (_, at) in tags.items() if rid in first}
    if name == "streams16k":
        big = next(rid for rid, (tag, _) in tags.items() if tag == "big")
        t0, t1 = tags[big][1], first[big]
        during = []
        for rid, gs in gaps.items():
            t = first[rid]
            for g in gs:
                t += g
                if t - g <= t1 + 0.5 and t >= t0:
                    during.append(g * 1000)
        return {"prompt_ttft_ms": ttft[big], "streams_max_gap_ms": max(during, default=None)}
    all_gaps = [g * 1000 for gs in gaps.values() for g in gs]
    return {"n": len(tags), "ttft_p50": pct(list(ttft.values()), 50), "ttft_p99": pct(list(ttft.values()), 99),
            "itl_p50": pct(all_gaps, 50), "itl_p99": pct(all_gaps, 99), "itl_max": max(all_gaps, default=None)}


# The H200's figures for the same scenarios, recorded with four ring slots, each batch formed
# before its slot: the `batch-before-slot` variant's code (gpu/results/serving.md, "No stall
# from READY on": raw/stalls.tar.xz, stalls/stalls-after.json and the server's access log
# beside it). TTFT is the server's (the access log's, from the handler to the
# first token: the model leaves the HTTP path out); for mix25 the probe's own figure also
# counts waiting for one of its 100 pooled connections (the server saw at most 101 at once).
RECORDED = {
    "mix25": {"ttft_p50": 213.0, "ttft_p99": 464.0, "itl_p50": 19.7, "itl_p99": 57.0},
    "mix10": {"ttft_p50": 100.0, "ttft_p99": 291.0, "itl_p50": 6.6, "itl_p99": 28.0},
    "prefix": {"ttft_p50": 37.0, "ttft_p99": 221.0},
    "streams16k": {"prompt_ttft_ms": 876.0, "streams_max_gap_ms": 73.4},
    # the four base bursts of raw/stalls.tar.xz lora_bursts/call2 (medians; server side)
    "burst200": {"ttft_p50": 126.0, "ttft_p99": 174.0, "itl_p50": 8.4, "itl_p99": 35.3},
}
FIELDS = {"burst200": ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"),
          "mix25": ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"),
          "mix10": ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"),
          "prefix": ("ttft_p50", "ttft_p99"),
          "streams16k": ("prompt_ttft_ms", "streams_max_gap_ms")}


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="burst200,mix25,mix10,prefix,streams16k")
    ap.add_argument("--variants", default="current,one-forward,itl40,one-forward+itl40,budget4k,ttft-slack0")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="the model of 'current' (two forwards a step) beside the recorded figures")
    ap.add_argument("--json", help="write every run's summary here")
    ap.add_argument("--fit", metavar="TRACE", help="fit the step costs to a ZEROD_STEP_TRACE file first")
    a = ap.parse_args()
    scenarios = [s for s in a.scenarios.split(",") if s]
    variants = [v for v in a.variants.split(",") if v]
    cost = None
    if a.fit:
        try:
            cost, err, n = fit_cost(a.fit)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--fit: {exc}")
        print(f"step costs fitted to {n} steps of {a.fit} (median error {err:.1%}): "
              + ", ".join(f"{f.name} {getattr(cost, f.name) * 1e6:.3g} us" for f in dataclasses.fields(Cost)
                          if f.name.endswith("_s") and not f.name.startswith("eager")))
    try:
        made = {name: variant(name, cost) for name in variants}
    except ValueError as exc:
        ap.error(str(exc))
    doc: dict = {}
    for s in scenarios:
        print(f"\n{s} (median of {a.seeds} seeds; milliseconds)")
        keys = FIELDS[s]
        print(f"{'variant':<22}" + "".join(f"{k:>20}" for k in keys))
        if a.check and s in RECORDED:
            print(f"{'H200 recorded':<22}" + "".join(f"{RECORDED[s][k]:>20.1f}" for k in keys))
        for vname in variants:
            runs = [summary(s, simulate(traffic(s, seed), made[vname])) for seed in range(a.seeds)]
            doc.setdefault(s, {})[vname] = runs
            meds = [median_of(runs, k) for k in keys]
            print(f"{vname:<22}" + "".join(f"{m:>20.1f}" if m is not None else f"{'-':>20}" for m in meds))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
