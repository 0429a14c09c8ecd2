"""The engine's normal latency, learned per load bucket.

Latency depends on load: inter-token latency grows with the batch, time to first
token with the queue. So each scrape interval's histogram deltas (TTFT, ITL) are
filed under the load of that interval — the concurrency, requests running plus
waiting — in buckets about 1.5x wide (…, 64-95, 96-127, 128-191, …), and a
window is only ever compared with the normal of its own bucket. A load ramp
then moves from bucket to bucket without looking like a regression; a bucket
with too little history has no normal yet and gives no verdict.

Three statistics are compared, each in its own bucket, and a fourth where a bucket has none:
- the p99 over the window (`latency_window_s`, a minute): the tail — a monitoring
  agent's GPU poll that took an incident's p99 from 90 to 320 ms;
- for ITL, the mean over its last `latency_shift_s` seconds: a sustained shift. A rogue
  job slows every step, but the minute's p99 moves late and little: it needs 1 % of the
  minute's observations slow, and buckets as coarse as the engines' hold most of a
  normal's ITL in one bucket, so a quantile inside it is an interpolation. The mean is
  exact (the histogram's sum over its count). Not for TTFT: a few seconds hold too few
  first tokens for a steady mean. The H200 run that showed it: docs/daemon.md.

- for ITL, the lowest mean of each of its last `latency_sustain_intervals` scrape
  intervals ("sustained"): the rogue job's shift within seconds. Every one of them
  must be over, so a stage's burst (a second or two) never is; the H200's 10-minute
  ramp stays under 1.04x its normal by it, the rogue job shows 2.1x three scrapes in.

- for ITL at a load with no normal yet, since a likely cause began (a new process on
  the GPU, a host alert): the lowest mean of each of the last `latency_sustain_intervals`
  intervals since against the mean of the minute before it, whatever the load then
  ("cause"). Under open-loop traffic a slower engine queues its requests: the load
  climbs to where the engine may never have run (an H100 at mixed 10 req/s went from
  12-23 to 48-95 concurrent requests under a rogue job, ITL 9 -> 40-58 ms).

A regression must show beyond the `SPARED` worst intervals of what is compared
(ranked by the statistic): when a stage of load starts at once, its burst of
arrivals queues first tokens behind their prefills and stalls every running
stream's steps for a second or two. That burst is over 1 % of a minute's
observations, so it alone would set the window's p99 — against a normal in
which bursts are rarer — though nothing regressed (the H200 ramp, docs/perf.md "Latency regression").
A sustained shift shows in every interval and fires `SPARED` scrape intervals
later than it would otherwise.

Intervals stay in the current window (`latency_window_s`) first and join the
normal only once they leave it, so the window is never compared with itself;
intervals that were part of a regression (`taint`) never join it. The normal
keeps `latency_baseline_s` (1 h) in one-minute slots per bucket.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from dataclasses import dataclass, field

from zerod.watchers.engine_metrics import Histogram

METRICS = ("ttft", "itl")
# concurrency bucket lower edges: about 1.5x apart, so a bucket spans loads whose
# step times differ far less than a regression factor
LOAD_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
SLOT_S = 60.0
SPARED = 2  # worst window intervals per bucket left out of its verdict (a burst spans one or two)


def load_bucket(concurrency: float) -> str:
    """The bucket's label: "0" (idle), "1", "64-95", …, "1024+"."""
    n = max(0, int(concurrency))
    if n < LOAD_EDGES[0]:
        return "0"
    i = bisect.bisect_right(LOAD_EDGES, n) - 1
    lo = LOAD_EDGES[i]
    if i + 1 == len(LOAD_EDGES):
        return f"{lo}+"
    hi = LOAD_EDGES[i + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


@dataclass
class Work:
    """The prompt work behind the latencies: requests that got their first token, their
    prompt tokens, how many of those the prefix cache had (not computed), and the
    seconds they span."""
    first_tokens: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    seconds: float = 0.0

    def plus(self, o: "Work") -> "Work":
        return Work(self.first_tokens + o.first_tokens, self.prompt_tokens + o.prompt_tokens,
                    self.cached_tokens + o.cached_tokens, self.seconds + o.seconds)

    @property
    def computed(self) -> float:
        return max(0.0, self.prompt_tokens - self.cached_tokens)

    @property
    def computed_per_request(self) -> float | None:
        if self.first_tokens <= 0:
            return None
        return self.computed / self.first_tokens

    @property
    def computed_per_s(self) -> float | None:
        return self.computed / self.seconds if self.seconds > 0 else None

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else 0.0


@dataclass
class Interval:
    """One scrape interval's observations."""
    t: float
    seconds: float
    bucket: str
    hists: dict[str, Histogram]
    work: Work = field(default_factory=Work)
    tainted: set[str] = field(default_factory=set)


@dataclass
class Slot:
    """One minute of the normal at one load, for one metric."""
    start: float
    hist: Histogram
    seconds: float
    work: Work


def _mean(h: Histogram) -> float | None:
    return h.sum / h.count if h.count > 0 else None


def _lowest_mean(intervals, metric: str, min_samples: int) -> tuple[float, int] | None:
    """(the lowest of the intervals' means, their observations together); None where one
    has no observation or all of them hold under min_samples."""
    hists = [iv.hists.get(metric) for iv in intervals]
    if any(h is None or h.count <= 0 for h in hists) or sum(h.count for h in hists) < max(1, min_samples):
        return None
    return min(_mean(h) for h in hists), int(sum(h.count for h in hists))


def _total_work(intervals) -> Work:
    """The prompt work of intervals (or normal slots) added up."""
    total = Work()
    for iv in intervals:
        total = total.plus(iv.work)
    return total


# the statistics compared: name -> its value of a histogram
STATS = {"p99": lambda h: h.quantile(0.99), "mean": _mean}


@dataclass
class Comparison:
    metric: str
    stat: str           # "p99" over the window, "mean" over its last seconds
    bucket: str
    value_s: float
    normal_s: float
    count: int
    normal_count: int
    # stat "cause": when the cause began (the normal is the minute before it)
    since: float | None = None

    @property
    def ratio(self) -> float:
        return self.value_s / self.normal_s if self.normal_s > 0 else math.inf


class LatencyBaseline:
    def __init__(self, window_s: float, baseline_s: float, history_s: float = 0.0) -> None:
        self.window_s = window_s
        self.baseline_s = baseline_s
        self.window: collections.deque[Interval] = collections.deque()
        # every interval of the last history_s seconds in order, whatever its load: the
        # minute before a cause began (since())
        self.history_s = max(history_s, window_s)
        self.recent: collections.deque[Interval] = collections.deque()
        # metric -> bucket -> slots, oldest first
        self.slots: dict[str, dict[str, collections.deque[Slot]]] = {m: {} for m in METRICS}
        self._last_t: float | None = None

    def add(self, t: float, concurrency: float, hists: dict[str, Histogram], work: Work | None = None) -> None:
        seconds = 0.0 if self._last_t is None else max(0.0, t - self._last_t)
        self._last_t = t
        work = dataclasses.replace(work or Work(), seconds=seconds)
        iv = Interval(t, seconds, load_bucket(concurrency), hists, work)
        self.window.append(iv)
        self.recent.append(iv)
        while self.window and t - self.window[0].t >= self.window_s:
            self._learn(self.window.popleft())
        while t - self.recent[0].t > self.history_s:
            self.recent.popleft()
        self._expire(t)

    def taint(self, metric: str) -> None:
        """The window shows a regression of `metric`: none of it becomes normal."""
        for iv in self.window:
            iv.tainted.add(metric)

    def _learn(self, iv: Interval) -> None:
        start = math.floor(iv.t / SLOT_S) * SLOT_S
        for metric, h in iv.hists.items():
            if metric in iv.tainted or h.count <= 0:
                continue
            slots = self.slots[metric].setdefault(iv.bucket, collections.deque())
            if slots and slots[-1].start == start:
                last = slots[-1]
                slots[-1] = Slot(start, last.hist.plus(h), last.seconds + iv.seconds, last.work.plus(iv.work))
            else:
                slots.append(Slot(start, h, iv.seconds, iv.work))

    def _expire(self, now: float) -> None:
        for by_bucket in self.slots.values():
            for bucket, slots in list(by_bucket.items()):
                while slots and now - slots[0].start > self.baseline_s + SLOT_S:
                    slots.popleft()
                if not slots:
                    del by_bucket[bucket]

    def current(self, metric: str, recent_s: float | None = None) -> dict[str, list[Histogram]]:
        """The window's observations of `metric` (its last recent_s seconds only, if
        given): each load bucket's intervals."""
        out: dict[str, list[Histogram]] = {}
        since = self.window[-1].t - recent_s if recent_s is not None and self.window else -math.inf
        for iv in self.window:
            if iv.t <= since:
                continue
            h = iv.hists.get(metric)
            if h is not None and h.count > 0:
                out.setdefault(iv.bucket, []).append(h)
        return out

    def normal(self, metric: str, bucket: str) -> Histogram:
        total = Histogram()
        for slot in self.slots[metric].get(bucket, ()):
            total = total.plus(slot.hist)
        return total

    def normal_seconds(self, metric: str, bucket: str) -> float:
        """How long the engine ran at that load in the normal."""
        return sum(slot.seconds for slot in self.slots[metric].get(bucket, ()))

    def has_normal(self, metric: str, bucket: str, min_samples: int, min_s: float) -> bool:
        """Whether that load's normal holds enough to judge by: min_samples observations
        over at least min_s seconds (the first seconds at a new load are no normal)."""
        return self.normal(metric, bucket).count >= min_samples and self.normal_seconds(metric, bucket) >= min_s

    def normal_work(self, metric: str, bucket: str) -> Work:
        return _total_work(self.slots[metric].get(bucket, ()))

    def window_work(self, bucket: str, recent_s: float | None = None) -> Work:
        """The window's work at that load (its last recent_s seconds only, if given)."""
        since = self.window[-1].t - recent_s if recent_s is not None and self.window else -math.inf
        return _total_work(iv for iv in self.window if iv.bucket == bucket and iv.t > since)

    def compare(self, metric: str, min_samples: int, normal_min_samples: int,
                normal_min_s: float = 0.0, stat: str = "p99",
                recent_s: float | None = None) -> list[Comparison]:
        """Each bucket of the window (its last recent_s seconds, if given) with enough
        observations, less its SPARED worst intervals by `stat`, against its normal's
        `stat` (buckets whose normal has too few observations, or spans less than
        normal_min_s, give no verdict: the first seconds at a new load — clients
        connecting, prompts arriving together — are no normal)."""
        value = STATS[stat]
        out = []
        for bucket, hists in self.current(metric, recent_s).items():
            if len(hists) <= SPARED:
                continue
            cur = Histogram()
            for h in sorted(hists, key=lambda h: value(h) or 0.0)[:-SPARED]:
                cur = cur.plus(h)
            if cur.count < max(1, min_samples):
                continue
            if not self.has_normal(metric, bucket, normal_min_samples, normal_min_s):
                continue
            base = self.normal(metric, bucket)
            now, normal = value(cur), value(base)
            if now is None or normal is None:
                continue
            out.append(Comparison(metric, stat, bucket, now, normal, int(cur.count), int(base.count)))
        return out

    def sustained(self, metric: str, intervals: int, min_samples: int, normal_min_samples: int,
                  normal_min_s: float = 0.0) -> list[Comparison]:
        """The last `intervals` scrape intervals, all at one load: the lowest of their
        means against the normal's mean ("sustained": a shift that holds in every one
        of them; a burst spans one or two). Fires `intervals` scrapes after a shift
        begins, where the window's mean, sparing its worst intervals, needs more."""
        last = list(self.window)[-intervals:] if intervals > 0 else []
        if len(last) < intervals or len({iv.bucket for iv in last}) != 1:
            return []
        lowest = _lowest_mean(last, metric, min_samples)
        bucket = last[0].bucket
        if lowest is None or not self.has_normal(metric, bucket, normal_min_samples, normal_min_s):
            return []
        base = self.normal(metric, bucket)
        normal = _mean(base)
        if normal is None:
            return []
        return [Comparison(metric, "sustained", bucket, lowest[0], normal, lowest[1], int(base.count))]

    def since(self, metric: str, t: float, before_s: float, intervals: int, min_samples: int,
              normal_min_samples: int, normal_min_s: float = 0.0) -> Comparison | None:
        """At a load with no normal yet: the last `intervals` scrape intervals, all begun at
        t or later, the lowest of their means against the mean of the `before_s` seconds
        before t, whatever the load then (stat "cause": a shift that began with what
        happened at t). Under open-loop traffic a slower engine queues its requests and
        moves to a load it may never have run at (docs/daemon.md); where it has, the
        normal of that load judges. None: the load has a normal, too few intervals since
        t, or under normal_min_s of them before it."""
        last = [iv for iv in self.recent if iv.t - iv.seconds >= t][-intervals:] if intervals > 0 else []
        if len(last) < intervals:
            return None
        bucket = last[-1].bucket
        if self.has_normal(metric, bucket, normal_min_samples, normal_min_s):
            return None
        lowest = _lowest_mean(last, metric, min_samples)
        if lowest is None:
            return None
        # the minute before counts whole: a regression since t taints it too (the window
        # spans both), and it stays the reference
        base, seconds = Histogram(), 0.0
        for iv in self.recent:
            if t - before_s < iv.t <= t and metric in iv.hists:
                base, seconds = base.plus(iv.hists[metric]), seconds + iv.seconds
        normal = _mean(base)
        if normal is None or base.count < max(1, min_samples) or seconds < normal_min_s:
            return None
        return Comparison(metric, "cause", bucket, lowest[0], normal, lowest[1], int(base.count), since=t)

    def work_between(self, lo: float, hi: float) -> Work:
        """The prompt work of the intervals that ended in (lo, hi]."""
        return _total_work(iv for iv in self.recent if lo < iv.t <= hi)

    def last_work(self, intervals: int) -> Work:
        """The prompt work of the last `intervals` scrape intervals."""
        return _total_work(list(self.recent)[-intervals:] if intervals > 0 else [])

    def normals(self) -> dict[str, dict[str, float | None]]:
        """{metric: {bucket: normal p99}} for /v1/engine."""
        return {m: {b: self.normal(m, b).quantile(0.99) for b in sorted(self.slots[m], key=_bucket_order)}
                for m in METRICS}


def _bucket_order(label: str) -> int:
    return int(label.split("-")[0].rstrip("+"))
