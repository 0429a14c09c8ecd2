"""The decode graphs' batch sizes placed by measured cost (engine/runner/decode_sizes.py):
the choice is the cheapest for every batch size the graphs must hold, and the probe
times the real model's projections."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from zerod.engine.runner import decode_sizes as ds
from zerod.engine.tuning import Tuning


def summed(costs: dict[int, float], chosen: list[int], cheapest: bool = False) -> float:
    """What the runner pays over batch sizes 1..max: each padded to the next chosen size
    (cheapest: to the cheapest chosen size that holds it, the bound for any rule)."""
    def pay(B):
        fits = [b for b in chosen if b >= B]
        return min(costs[b] for b in fits) if cheapest else costs[fits[0]]
    return sum(pay(B) for B in range(1, max(costs) + 1))


def brute(costs: dict[int, float], count: int) -> float:
    """The least cost of any `count` sizes holding the small ones and the largest, each
    batch served by the cheapest of them that fits."""
    sizes = sorted(costs)
    forced = {b for b in ds.SMALL if b in costs} | {sizes[-1]}
    pool = [b for b in sizes if b not in forced]
    best = float("inf")
    for k in range(0, max(0, count - len(forced)) + 1):
        for extra in itertools.combinations(pool, k):
            best = min(best, summed(costs, sorted(forced | set(extra)), cheapest=True))
    return best


def test_candidates_cover_every_multiple_of_eight_and_the_largest():
    assert ds.candidates(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert ds.candidates(100)[-2:] == [96, 100]
    assert ds.candidates(3) == [1, 2, 3]


@pytest.mark.parametrize("seed", range(12))
def test_choice_is_the_cheapest_set_of_that_many(seed, monkeypatch):
    rnd = random.Random(seed)
    sizes = ds.candidates(rnd.choice([48, 64, 72]))
    # a rising cost with cliffs above the small sizes, as cuBLAS's heuristics give
    costs = {b: 10 + b * 0.1 + (rnd.random() * 4 if b > 8 and rnd.random() < 0.4 else 0) for b in sizes}
    count = rnd.randint(len(ds.SMALL) + 1, len(ds.SMALL) + 4)
    best = brute(costs, count)
    # exact without the noise margin: no rule of padding does better with that many graphs
    monkeypatch.setattr(ds, "UNDERCUT", 0.0)
    chosen = ds.choose(costs, count)
    assert len(chosen) <= count
    assert set(ds.SMALL) | {max(sizes)} <= set(chosen)
    assert summed(costs, chosen) == pytest.approx(best)
    # with it, within the margin
    monkeypatch.undo()
    assert summed(costs, ds.choose(costs, count)) <= best * (1 + ds.UNDERCUT)


def test_a_size_a_larger_one_undercuts_is_never_captured():
    # the H200's FP8 projections of the 8B shape, µs a layer (gpu/results/kernels.md):
    # 256 rows cost less than 200 or 224, so a batch of 200 is best padded to 256
    costs = {b: 100.0 for b in ds.candidates(256)}
    costs.update({200: 135.5, 224: 127.1, 256: 121.3})
    chosen = ds.choose(costs, 16)
    assert 200 not in chosen and 224 not in chosen and 256 in chosen


def test_a_cliff_gets_a_graph_below_it():
    # bf16: 200 rows 153 µs a layer, 224 180, 256 176: the ladder's 224 is dearer than both
    costs = {b: 80 + 0.35 * b for b in ds.candidates(256)}
    costs.update({200: 153.0, 208: 175.0, 216: 178.0, 224: 180.0, 232: 181.0, 240: 178.0, 248: 177.0, 256: 176.0})
    chosen = ds.choose(costs, 16)
    assert 200 in chosen
    assert summed(costs, chosen) < summed(costs, ds.graph_buckets(256))


def test_noise_between_near_equal_sizes_keeps_the_small_graphs():
    costs = {b: 50.0 + (0.5 if b in (1, 2) else 0) for b in ds.candidates(64)}
    assert {1, 2, 4, 8, 64} <= set(ds.choose(costs, 8))


def test_enough_graphs_for_every_candidate_takes_them_all_when_cost_rises():
    costs = {b: float(b) for b in ds.candidates(64)}
    assert ds.choose(costs, 100) == ds.candidates(64)


def test_the_tuning_default_places_16_graphs_and_refuses_a_negative_count():
    assert Tuning().decode_graphs_by_cost == 16
    with pytest.raises(ValueError, match="decode_graphs_by_cost"):
        Tuning(decode_graphs_by_cost=-1)


def tiny_model(**extra):
    from zerod.engine.model.decoder import LlamaModel
    from zerod.engine.spec.hf_config import parse_model_config

    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=256)
    raw.update(extra)
    model = LlamaModel(parse_model_config(raw), torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("extra", [{}, dict(architectures=["MixtralForCausalLM"], num_local_experts=4,
                                            num_experts_per_tok=2)])
def test_probe_times_the_model_projections_at_each_size(extra):
    model = tiny_model(**extra)
    costs = ds.probe(model, [1, 8, 16], torch.device("cpu"))
    assert sorted(costs) == [1, 8, 16]
    assert all(c > 0 for c in costs.values())


def test_a_runner_places_its_graphs_by_cost_unless_the_tuning_says_0(monkeypatch):
    from types import SimpleNamespace

    model = tiny_model()
    r = SimpleNamespace(model=model, device=torch.device("cpu"), tuning=Tuning(decode_graphs_by_cost=0))
    assert ds.decode_sizes(r, 64) == (ds.graph_buckets(64), None)
    r.tuning = Tuning(decode_graphs_by_cost=6)
    sizes, costs = ds.decode_sizes(r, 64)
    assert sorted(costs) == ds.candidates(64) and len(sizes) <= 6 and sizes[-1] == 64
    model.tp = SimpleNamespace(rank=0, world=2)     # ranks must capture alike: the ladder
    assert ds.decode_sizes(r, 64) == (ds.graph_buckets(64), None)
