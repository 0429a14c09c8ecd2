"""The daemon's hour of history (zerod.history, GET /v1/history): rings sized to an
hour at the sampling rate, bucketed by max into the points a client asks for."""

from __future__ import annotations

import pytest

from zerod.history import KEEP_S, HistoryError, HistoryRecorder, NoSuchSeries, bucket_max, query_args


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def recorder(clock, gpus, engines, interval=1.0):
    return HistoryRecorder(interval, lambda: gpus, lambda: list(engines.items()), clock=clock)


def test_keeps_one_hour_at_the_sampling_rate():
    clock = Clock(1000.0)
    gpus = {0: {"utilization_ratio": 0.5, "memory_used_bytes": 10, "power_watts": 100.0, "temperature_celsius": 40}}
    r = recorder(clock, gpus, {"a": {"output_tokens_per_s": 10.0, "itl_p99_s": 0.01}}, interval=2.0)
    for _ in range(int(KEEP_S / 2) + 50):
        clock.t += 2.0
        r.poll()
    assert len(r.times) == KEEP_S / 2 == r.maxlen
    assert r.times[0] == clock.t - KEEP_S + 2.0


def test_zoom_buckets_by_max_and_leaves_gaps_null():
    clock = Clock(0.0)
    gpus = {0: {"utilization_ratio": 0.0, "memory_used_bytes": 1, "power_watts": 50.0, "temperature_celsius": 30}}
    engines = {"a": {"output_tokens_per_s": 0.0, "itl_p99_s": None}}
    r = recorder(clock, gpus, engines)
    for i in range(120):
        clock.t = float(i + 1)
        gpus[0]["utilization_ratio"] = 0.9 if i == 100 else 0.1  # one spike
        engines["a"]["itl_p99_s"] = 0.02 if i >= 60 else None
        r.poll()
    doc = r.query(seconds="120", points="12")
    util = doc["gpus"][0]["series"]["utilization_ratio"]
    assert len(util) == 12 and doc["step_s"] == 10.0 and doc["samples"] == 120
    assert util[10] == 0.9 and max(util[:10]) == 0.1  # the spike survives zooming out
    itl = doc["engines"][0]["series"]["itl_p99_s"]
    assert itl[:6] == [None] * 6 and itl[6:] == [0.02] * 6
    # zoomed in to the last 10 s: one point per sample
    near = r.query(seconds=10, points=10)
    assert near["gpus"][0]["series"]["utilization_ratio"] == [0.1] * 10


def test_a_gpu_that_appears_later_has_nulls_before():
    clock = Clock(0.0)
    gpus: dict = {}
    r = recorder(clock, gpus, {})
    for i in range(10):
        clock.t = float(i + 1)
        if i == 5:
            gpus[1] = {"utilization_ratio": 1.0, "memory_used_bytes": 5, "power_watts": 1.0, "temperature_celsius": 1}
        r.poll()
    s = r.query(seconds=10, points=10)["gpus"][0]["series"]["utilization_ratio"]
    assert s == [None] * 5 + [1.0] * 5


@pytest.mark.parametrize("args, msg", [
    ({"seconds": "soon"}, "seconds must be a number"),
    ({"seconds": "0"}, "seconds must be between 1 and 3600"),
    ({"seconds": "7200"}, "seconds must be between 1 and 3600"),
    ({"points": "nan"}, "points must be between"),
    ({"points": "0"}, "points must be between"),
])
def test_bad_queries_are_refused_by_name(args, msg):
    r = recorder(Clock(1.0), {}, {})
    with pytest.raises(HistoryError, match=msg):
        r.query(**args)


def test_an_unknown_engine_is_named_with_the_known_ones():
    r = recorder(Clock(1.0), {}, {"a": {}, "b": {}})
    r.poll()
    with pytest.raises(NoSuchSeries, match="no engine named 'c'.*engines: a, b"):
        r.query(engine="c")


def test_bucket_max_ignores_samples_outside_the_window():
    assert bucket_max([0.0, 5.0, 6.0, 15.0, 26.0], [9.0, 8.0, 1.0, 2.0, 3.0], 5.0, 10.0, 2) == [2.0, None]


def test_query_args_refuse_an_unknown_parameter_by_name():
    assert query_args({"seconds": "60"}) == {"seconds": "60", "points": None, "engine": None}
    with pytest.raises(HistoryError, match="unknown parameter 'window': /v1/history takes seconds, points, engine"):
        query_args({"window": "60", "seconds": "60"})
