"""The step-cost model and the chunk budget it gives the scheduler."""

import pytest

from zerod.engine.step_cost import StepCost

KW = dict(cap=2048, min_chunk=256, target_itl=0.050, target_ttft=0.300)


def _trained(base_s=0.010, per_token_s=0.00003, decodes=64) -> StepCost:
    c = StepCost()
    for _ in range(5):
        c.observe(0, decodes, base_s)
        c.observe(1024, decodes, base_s + 1024 * per_token_s)
    return c


def test_until_measured_the_fixed_budget_holds():
    c = StepCost()
    assert c.chunk_budget(10, 5000, **KW) == 2048
    c.observe(0, 10, 0.01)
    assert c.chunk_budget(10, 5000, **KW) == 2048


def test_learns_base_and_per_token_cost():
    c = _trained()
    assert c.decode_time(64) == pytest.approx(0.010)
    assert c.per_token == pytest.approx(0.00003)
    # a decode batch of a size never seen takes the next measured bucket up, else the largest
    assert c.decode_time(40) == pytest.approx(0.010) and c.decode_time(200) == pytest.approx(0.010)


def test_a_small_backlog_gets_small_steps():
    c = _trained()
    # 300 tokens to clear in 300 ms: the floor is enough
    assert c.chunk_budget(64, 300, **KW) == 256


def test_a_large_backlog_grows_the_chunk_up_to_the_itl_bound():
    c = _trained()
    mid = c.chunk_budget(64, 4000, **KW)
    # 4000 tokens at 0.03 ms each: P = 4000 * 10 ms / (300 - 120 ms) = 222 -> floor 256;
    big = c.chunk_budget(64, 8000, **KW)
    # 8000: 8000 * 10 / (300 - 240) = 1333, and 10 ms + 1333 * 0.03 ms = 50 ms: at the ITL bound
    assert mid == 256 and 1300 <= big <= 1340
    # more than can be cleared in time: the ITL bound, (50 - 10) / 0.03 = 1333
    assert c.chunk_budget(64, 100_000, **KW) == pytest.approx(1333, abs=2)


def test_prefill_keeps_its_floor_when_decode_alone_fills_the_itl_target():
    c = _trained(base_s=0.060)
    assert c.chunk_budget(64, 100_000, **KW) == 256


def test_never_above_the_cap():
    c = _trained(per_token_s=0.000001)
    assert c.chunk_budget(64, 100_000, **KW) == 2048


def test_nonsense_samples_are_ignored():
    c = _trained()
    c.observe(0, 64, 0.0)
    c.observe(10, 64, 5.0)           # too few tokens to say what one costs
    c.observe(1024, 64, float("nan"))
    assert c.per_token == pytest.approx(0.00003) and c.decode_time(64) == pytest.approx(0.010)
