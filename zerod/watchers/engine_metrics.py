"""The engine's own figures: scrape its /metrics every second.

Keeps the last scrape (gauges, counters, the TTFT/ITL histograms) and a short
series of samples for the latency watcher. Alerts: `AllocatorRetries` on any
increase of `zerod_engine_allocator_retries_total` or `_allocator_ooms_total`,
`StreamErrors` on any increase of `zerod_engine_stream_errors_total` (the names
are zerod.engine.metrics', the one list), each
held `counter_alert_hold_s` after the last increase. Counters start at zero
with each engine process (a restart is a new baseline, not a decrease).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engine import metrics as names
from zerod.engines import PRESETS
from zerod.fleet import DEFAULT_NAME, EngineSpec
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher

TTFT = names.TIME_TO_FIRST_TOKEN_SECONDS
ITL = names.INTER_TOKEN_LATENCY_SECONDS
HISTOGRAMS = (TTFT, ITL)


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    count: float = 0.0
    sum: float = 0.0

    def minus(self, older: "Histogram") -> "Histogram":
        return Histogram({le: c - older.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.count - older.count, self.sum - older.sum)

    def plus(self, other: "Histogram") -> "Histogram":
        les = self.buckets.keys() | other.buckets.keys()
        return Histogram({le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in les},
                         self.count + other.count, self.sum + other.sum)

    def quantile(self, q: float) -> float | None:
        """histogram_quantile(): linear inside the bucket, as Prometheus does."""
        if self.count <= 0 or not self.buckets:
            return None
        les = sorted(self.buckets)
        rank = q * self.buckets[les[-1]] if math.isinf(les[-1]) else q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le in les:
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return les[-1] if not math.isinf(les[-1]) else prev_le


@dataclass
class Sample:
    t: float
    values: dict[str, float]
    ttft: Histogram
    itl: Histogram


def _labels(s: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(s):
        eq = s.find("=", i)
        if eq < 0:
            break
        key = s[i:eq].strip().lstrip(",").strip()
        j = eq + 2  # past ="
        val = []
        while j < len(s) and s[j] != '"':
            if s[j] == "\\" and j + 1 < len(s):
                j += 1
                val.append({"n": "\n"}.get(s[j], s[j]))
            else:
                val.append(s[j])
            j += 1
        out[key] = "".join(val)
        i = j + 1
    return out


def parse_metrics(text: str, series: dict[str, tuple[str, ...]] | None = None
                  ) -> tuple[dict[str, float], Histogram, Histogram]:
    """The few series the daemon reads, from Prometheus text format (a small
    parser: the scrape runs every second and must stay cheap), under the
    daemon's names: `series` maps each to the engine's own names (zerod.engines;
    the first one present wins). A series with several label sets (one per
    model, per data-parallel rank) is summed."""
    series = series or PRESETS["zerod"].series
    wanted = {alias for aliases in series.values() for alias in aliases}
    hists: dict[str, Histogram] = {}
    raw: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = line.find("{")
        sp = line.rfind(" ")
        if sp < 0:
            continue
        if name_end < 0 or name_end > sp:
            name, labels = line[:sp].strip(), ""
        else:
            name = line[:name_end]
            labels = line[name_end + 1:line.rfind("}")]
        base = name
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in wanted:
                base = name[: -len(suffix)]
                break
        if base == name and name not in wanted:
            continue
        rest = line[sp + 1:].strip()
        try:
            value = float(rest)
        except ValueError:  # "value timestamp"
            try:
                value = float(line[:sp].rsplit(" ", 1)[-1])
            except ValueError:
                continue
        if base != name:
            h = hists.setdefault(base, Histogram())
            if name.endswith("_bucket"):
                le = _labels(labels).get("le", "+Inf")
                le_f = float("inf") if le in ("+Inf", "Inf") else float(le)
                h.buckets[le_f] = h.buckets.get(le_f, 0.0) + value
            elif name.endswith("_count"):
                h.count += value
            else:
                h.sum += value
        else:
            raw[name] = raw.get(name, 0.0) + value
    values: dict[str, float] = {}
    out = {TTFT: Histogram(), ITL: Histogram()}
    for own, aliases in series.items():
        if own in out:
            found = next((hists[a] for a in aliases if a in hists), None)
            if found is not None:
                out[own] = found
        else:
            found_v = next((raw[a] for a in aliases if a in raw), None)
            if found_v is not None:
                values[own] = found_v
    return values, out[TTFT], out[ITL]


@owns(alerts=(AlertRule("AllocatorRetries", "warning", "the engine's CUDA allocator retried or ran out of memory "
                        "(its counters went up; they start at 0 with each engine process)"),
              AlertRule("StreamErrors", "critical", "CUDA stream errors in the engine")))
class EngineMetricsWatcher(Watcher):
    name = "engine_metrics"
    blocking = False

    def __init__(self, book: AlertBook, cfg: DaemonConfig, url: str | Callable[[], str],
                 engine_pid: Callable[[], int | None], up: Callable[[], bool] = lambda: True,
                 clock=time.time, keep_s: float | None = None,
                 series: dict[str, tuple[str, ...]] | None = None, spec: EngineSpec | None = None) -> None:
        super().__init__()
        self.spec = spec or EngineSpec(DEFAULT_NAME, (), {})
        if self.spec.tagged:
            self.name = f"{self.name}:{self.spec.name}"
        self.series = series or PRESETS["zerod"].series  # the engine's names for the daemon's series
        self.book = book
        self.cfg = cfg
        self.interval_s = cfg.watch_interval_s
        self._url = url
        self.engine_pid = engine_pid
        self.up = up
        self.clock = clock
        keep = keep_s or (cfg.latency_window_s + 10 * cfg.watch_interval_s)
        self.samples: collections.deque[Sample] = collections.deque(
            maxlen=int(keep / cfg.watch_interval_s) + 2)
        self.last: Sample | None = None
        self.last_error: str | None = None
        self._pid: int | None = None
        self._base: dict[str, float] = {}
        self._alert_at: dict[str, float] = {}
        self._session = None

    @property
    def url(self) -> str:
        return self._url() if callable(self._url) else self._url

    async def fetch(self) -> str:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET /metrics: HTTP {r.status}")
            return await r.text()

    async def apoll(self) -> None:
        pid = self.engine_pid()
        if pid is None or not self.up():
            self._expire(self.clock())
            return
        try:
            text = await self.fetch()
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return
        self.ingest(text, pid)

    def ingest(self, text: str, pid: int | None = None, now: float | None = None) -> Sample:
        now = self.clock() if now is None else now
        values, ttft, itl = parse_metrics(text, self.series)
        if pid != self._pid:  # a new engine process: counters start again
            self._pid = pid
            self._base = {}
            self.samples.clear()
        s = Sample(now, values, ttft, itl)
        self.samples.append(s)
        self.last = s
        self.last_error = None
        self._counter_alerts(values, now)
        return s

    def _counter_alerts(self, values: dict[str, float], now: float) -> None:
        def delta(name: str) -> float:
            v = values.get(name)
            if v is None:
                return 0.0
            prev = self._base.get(name, 0.0)
            self._base[name] = v
            return v - prev if v >= prev else v  # a decrease is a reset

        d_retry = delta(names.ALLOCATOR_RETRIES_TOTAL)
        d_oom = delta(names.ALLOCATOR_OOMS_TOTAL)
        d_err = delta(names.STREAM_ERRORS_TOTAL)
        g = lambda name: int(values.get(name, 0))  # noqa: E731
        if d_retry > 0 or d_oom > 0:
            self._alert_at["AllocatorRetries"] = now
            self.book.fire("AllocatorRetries", self.spec.key(), severity="warning", labels=self.spec.labels,
                           summary=f"engine{self.named} allocator under pressure: +{d_retry:.0f} retries, +{d_oom:.0f} OOMs",
                           description=f"torch's caching allocator had to free its cache and retry "
                                       f"({g(names.ALLOCATOR_RETRIES_TOTAL)} retries, {g(names.ALLOCATOR_OOMS_TOTAL)} "
                                       f"OOMs since the engine started): GPU memory is short, often because "
                                       f"another process took some",
                           fix="lower [engine] gpu_memory_utilization or max_num_seqs; look for foreign GPU processes")
        if d_err > 0:
            self._alert_at["StreamErrors"] = now
            self.book.fire("StreamErrors", self.spec.key(), severity="critical", labels=self.spec.labels,
                           summary=f"engine{self.named} saw {d_err:.0f} CUDA stream error(s) ({g(names.STREAM_ERRORS_TOTAL)} in all)",
                           description="a CUDA event or stream query returned an error: the engine's health fails and "
                                       "zerod restarts it; look for an Xid in the kernel log",
                           fix="journalctl -k | grep -i xid; nvidia-smi -q -d ECC")
        self._expire(now)

    def _expire(self, now: float) -> None:
        for name, t in list(self._alert_at.items()):
            if now - t >= self.cfg.counter_alert_hold_s:
                del self._alert_at[name]
                self.book.resolve(name, self.spec.key())

    @property
    def named(self) -> str:
        return f" {self.spec.name}" if self.spec.tagged else ""

    def window(self, seconds: float) -> tuple[Sample, Sample] | None:
        """(oldest sample at least `seconds` old, or the oldest there is; newest)."""
        if len(self.samples) < 2:
            return None
        newest = self.samples[-1]
        older = self.samples[0]
        for s in self.samples:
            if newest.t - s.t >= seconds:
                older = s
            else:
                break
        return older, newest

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
