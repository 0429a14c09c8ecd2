"""The daemon's hour of history, served as GET /v1/history (docs/control-api.md):
per GPU utilization, memory, power and temperature, per engine output tokens/s
and ITL p99, one sample per `watch_interval_s`.

A watcher of its own: each poll copies the figures the other watchers already
hold (nothing here reads NVML or the engine) into rings sized to an hour at the
sampling rate. A request picks a window and a number of points: the ring is
bucketed by max (a spike stays visible when zoomed out) and a bucket with no
sample is null.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from zerod.watchers import Watcher

KEEP_S = 3600.0
GPU_SERIES = ("utilization_ratio", "memory_used_bytes", "power_watts", "temperature_celsius")
ENGINE_SERIES = ("output_tokens_per_s", "itl_p99_s")
MAX_POINTS = 3600
QUERY_KEYS = ("seconds", "points", "engine")


class HistoryError(ValueError):
    """A query the endpoint refuses; the message says which parameter and why."""


class NoSuchSeries(LookupError):
    """`engine=NAME` names no engine with history; the message lists them."""


def bucket_max(times: list[float], values: list[float | None], start: float, step: float,
               points: int) -> list[float | None]:
    """`points` buckets of `step` seconds after `start` (each closed at its end, so the
    newest sample lands in the last): the largest sample in each, null if none."""
    out: list[float | None] = [None] * points
    for t, v in zip(times, values):
        if v is None:
            continue
        i = math.ceil((t - start) / step) - 1
        if 0 <= i < points and (out[i] is None or v > out[i]):
            out[i] = v
    return out


class HistoryRecorder(Watcher):
    name = "history"

    def __init__(self, interval_s: float, gpus: Callable[[], dict[int, dict[str, Any]]],
                 engines: Callable[[], Iterable[tuple[str, dict[str, Any]]]], clock=time.time) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.maxlen = max(1, math.ceil(KEEP_S / max(interval_s, 0.01)))
        self._gpus = gpus
        self._engines = engines
        self.clock = clock
        self.times: collections.deque[float] = collections.deque(maxlen=self.maxlen)
        self.gpu_rings: dict[int, dict[str, collections.deque]] = {}
        self.engine_rings: dict[str, dict[str, collections.deque]] = {}
        # poll() runs in a worker thread, query() on the event loop: a query copies every
        # ring at one instant, so a time and its values stay paired
        self._lock = threading.Lock()

    def _ring(self, rings: dict, key, names: tuple[str, ...]) -> dict[str, collections.deque]:
        if key not in rings:  # a GPU or engine that appears later: nulls for the samples before it
            rings[key] = {n: collections.deque([None] * len(self.times), maxlen=self.maxlen) for n in names}
        return rings[key]

    def poll(self) -> None:
        now = self.clock()
        gpus = self._gpus()
        engines = dict(self._engines())
        with self._lock:
            self._append(now, gpus, engines)

    def _append(self, now: float, gpus: dict[int, dict[str, Any]], engines: dict[str, dict[str, Any]]) -> None:
        for idx in set(self.gpu_rings) | set(gpus):
            ring = self._ring(self.gpu_rings, idx, GPU_SERIES)
            g = gpus.get(idx) or {}
            for n in GPU_SERIES:
                ring[n].append(g.get(n))
        for name in set(self.engine_rings) | set(engines):
            ring = self._ring(self.engine_rings, name, ENGINE_SERIES)
            e = engines.get(name) or {}
            for n in ENGINE_SERIES:
                ring[n].append(e.get(n))
        self.times.append(now)

    def query(self, seconds: Any = None, points: Any = None, engine: str | None = None,
              now: float | None = None) -> dict[str, Any]:
        """The document of GET /v1/history (parameters as the query string gives them)."""
        seconds = _number("seconds", seconds, KEEP_S, 1.0, KEEP_S)
        points = int(_number("points", points, min(MAX_POINTS, seconds / self.interval_s), 1, MAX_POINTS))
        now = self.clock() if now is None else now
        step = seconds / points
        start = now - seconds
        with self._lock:
            times = list(self.times)
            gpu_rings = {idx: {n: list(dq) for n, dq in ring.items()} for idx, ring in self.gpu_rings.items()}
            engine_rings = {name: {n: list(dq) for n, dq in ring.items()} for name, ring in self.engine_rings.items()}
        if engine is not None and engine not in engine_rings:
            raise NoSuchSeries(f"no engine named {engine!r} in the history; engines: "
                               f"{', '.join(sorted(engine_rings)) or 'none'}")
        engines = [engine] if engine is not None else sorted(engine_rings)
        return {
            "interval_s": self.interval_s, "keep_s": KEEP_S, "seconds": seconds, "points": points,
            "step_s": step, "start": start, "end": now, "samples": sum(1 for t in times if t > start),
            "gpus": [{"index": idx, "series": {n: bucket_max(times, ring[n], start, step, points)
                                               for n in GPU_SERIES}}
                     for idx, ring in sorted(gpu_rings.items())],
            "engines": [{"name": name, "series": {n: bucket_max(times, engine_rings[name][n], start, step, points)
                                                  for n in ENGINE_SERIES}}
                        for name in engines],
        }


def query_args(params: Mapping[str, str]) -> dict[str, str | None]:
    """The arguments of `query()` from a query string; a parameter it does not take is
    refused by name (a typo must not silently give the default window)."""
    unknown = sorted(set(params) - set(QUERY_KEYS))
    if unknown:
        raise HistoryError(f"unknown parameter {unknown[0]!r}: /v1/history takes {', '.join(QUERY_KEYS)}")
    return {k: params.get(k) for k in QUERY_KEYS}


def _number(name: str, raw: Any, default: float, lo: float, hi: float) -> float:
    if raw is None or raw == "":
        return max(lo, min(hi, default))
    try:
        x = float(raw)
    except (TypeError, ValueError):
        raise HistoryError(f"{name} must be a number, got {str(raw)[:40]!r}") from None
    if not math.isfinite(x) or x < lo or x > hi:
        raise HistoryError(f"{name} must be between {lo:g} and {hi:g}, got {x:g}")
    return x
