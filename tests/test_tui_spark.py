"""What a sparkline draws: scaled bars, and a flat series at zero as the lowest bar."""

from __future__ import annotations

from zerod.tui.widgets.spark import BARS, levels, resample


def drawn(data, lo=None, hi=None) -> str:
    return "".join(BARS[level] for level in levels(data, lo, hi))


def test_an_idle_engine_draws_the_lowest_bar_not_half_height():
    assert drawn([0.0] * 5, lo=0.0) == "▁▁▁▁▁"  # requests running, tokens/s
    assert drawn([0.0] * 5) == "▁▁▁▁▁"  # no bounds pinned at all


def test_a_flat_busy_series_with_nothing_to_scale_against_draws_mid_height():
    assert drawn([7.0, 7.0, 7.0]) == "▄▄▄"


def test_pinned_bounds_scale_every_value():
    assert drawn([0, 50, 100], lo=0, hi=100) == "▁▅█"
    assert drawn([97, 97], lo=0, hi=100) == "██"  # a flat 97 % does not look like 0 %
    assert drawn([250], lo=0, hi=100) == "█"  # beyond the bound: clipped, not an error


def test_long_histories_keep_the_peak_of_each_bucket():
    assert resample([0, 9, 0, 0, 1, 0], 3) == [9, 0, 1]
    assert resample([1, 2], 8) == [1, 2]
