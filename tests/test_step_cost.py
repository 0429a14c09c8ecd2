"""The step-cost model and the chunk budget it gives the scheduler."""

import pytest

from zerod.engine.core.step_cost import Pending, StepCost

KW = dict(cap=2048, min_chunk=256, target_itl=0.050, target_ttft=0.100)
BASE, FIXED, PER = 0.006, 0.006, 0.00002     # an 8B-like step: 6 ms decode, 6 ms + 20 us/token prefill


def _trained(base=BASE, fixed=FIXED, per=PER, decodes=64) -> StepCost:
    c = StepCost()
    for p in (128, 512, 1024, 2048, 300, 1500) * 3:
        c.observe(0, decodes, base)
        c.observe(p, decodes, base + fixed + per * p)
    return c


def test_until_measured_the_fixed_budget_holds():
    c = StepCost()
    assert c.chunk_budget(10, [Pending(5000, 0.0, 5000)], **KW) == 2048
    c.observe(0, 10, 0.01)
    assert c.chunk_budget(10, [Pending(5000, 0.0, 5000)], **KW) == 2048


def test_learns_the_decode_base_and_the_prefill_line():
    c = _trained()
    assert c.decode_time(64) == pytest.approx(BASE)
    fixed, per = c.prefill_line()
    assert fixed == pytest.approx(FIXED, rel=1e-6) and per == pytest.approx(PER, rel=1e-6)
    # a decode batch of a size never seen takes the next measured bucket up, else the largest
    assert c.decode_time(40) == pytest.approx(BASE) and c.decode_time(200) == pytest.approx(BASE)


def test_one_prompt_size_still_gives_a_usable_per_token_cost():
    c = StepCost()
    for _ in range(5):
        c.observe(0, 8, BASE)
        c.observe(1000, 8, BASE + FIXED + PER * 1000)
    fixed, per = c.prefill_line()
    assert fixed == 0.0 and per == pytest.approx((FIXED + PER * 1000) / 1000)


def test_a_lone_long_prompt_at_low_load_gets_small_steps():
    """10 req/s: a 4096-token prompt arrives while streams decode. Its deadline is
    100 ms + its ~82 ms prefill: chunks of 4096 x 12 ms / (182 - 82) ms = 491 tokens meet
    it and keep ITL near 22 ms, under the 50 ms the ITL target allows."""
    c = _trained()
    assert c.chunk_budget(64, [Pending(4096, 0.0, 4096)], **KW) == 491


def test_without_slack_a_long_prompt_is_held_to_the_ttft_target_alone():
    """Tuning.long_prompt_slack 0: the 4096-token prompt's deadline is 100 ms, less than
    its own ~82 ms prefill plus a step's 12 ms base each chunk allows at 491 tokens: the
    chunk grows to what 100 ms needs, (4096 x 12 ms) / (100 - 82 ms) = 2,719, then the
    ITL bound (1,900) caps it."""
    def trained(slack):
        c = StepCost(slack)
        for p in (128, 512, 1024, 2048, 300, 1500) * 3:
            c.observe(0, 64, BASE)
            c.observe(p, 64, BASE + FIXED + PER * p)
        return c
    assert trained(1.0).chunk_budget(64, [Pending(4096, 0.0, 4096)], **KW) == 491
    assert trained(0.0).chunk_budget(64, [Pending(4096, 0.0, 4096)], **KW) == pytest.approx(1900, abs=2)


def test_a_burst_of_short_prompts_gets_big_steps_up_to_the_itl_bound():
    """200 streams arriving at once: 24-token prompts due within ~100 ms; too many for that,
    so the chunk is as large as target_itl allows: (50 - 12 ms) / 20 us = 1900 tokens."""
    c = _trained()
    burst = [Pending(24, 0.001, 24) for _ in range(64)] + [Pending(126 * 24, 0.001, 24)]
    assert c.chunk_budget(64, burst, **KW) == pytest.approx(1900, abs=2)


def test_an_old_prompt_raises_the_chunk():
    c = _trained()
    fresh = c.chunk_budget(64, [Pending(600, 0.0, 600)], **KW)
    late = c.chunk_budget(64, [Pending(600, 0.120, 600)], **KW)
    assert fresh == 256 and late > fresh


def test_prefill_keeps_its_floor_when_decode_alone_fills_the_itl_target():
    c = _trained(base=0.060)
    assert c.chunk_budget(64, [Pending(100_000, 1.0, 100_000)], **KW) == 256


def test_never_above_the_cap():
    c = _trained(per=0.000001)
    assert c.chunk_budget(64, [Pending(100_000, 1.0, 100_000)], **KW) == 2048


def test_nonsense_samples_are_ignored():
    c = _trained()
    c.observe(0, 64, 0.0)
    c.observe(1024, 64, float("nan"))
    assert c.prefill_line()[1] == pytest.approx(PER, rel=1e-6) and c.decode_time(64) == pytest.approx(BASE)
