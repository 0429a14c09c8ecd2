"""Engine latency over the last minute, from the engine's histograms, and
`LatencyRegression` when it leaves its normal.

p50/p99 of TTFT and ITL are computed from the difference of two scrapes a
`latency_window_s` apart (histogram_quantile over bucket deltas, as
Prometheus' `rate()` + `histogram_quantile()` would).

`LatencyRegression` fires, on by default, when the window's p99 at some load, or
(for ITL) the mean of its last `latency_shift_s` seconds, exceeds `latency_regression_factor`
times the normal's at that load (zerod.watchers.latency_baseline: learned per
concurrency bucket over `latency_baseline_s`; why the two, there), or (for ITL, at a
load with no normal yet) its mean since a likely cause began exceeds the factor times
its mean of the minute before (a slower engine under open-loop traffic queues its
requests into a load it has never run at), and — as an
option — when a p99 exceeds an absolute SLO
(`slo_itl_p99_s`, `slo_ttft_p99_s`); either needs `latency_min_samples`
observations in the window. A relative test is what catches the source
document's incident (a monitoring agent's GPU poll taking P99 from 90 to
320 ms) and the rogue job that doubled ITL on the H200 while staying under any
sensible SLO. The alert names the likely cause: a foreign GPU process that
appeared within `cause_window_s` before the regression began (or since), else
throttling, an Xid, PCIe replays, ECC errors or a failing preflight check that
began then — or says that none was found. With none of those, a latency over its
normal that the engine's prompt work explains (each request needed the factor
times more prompt tokens computed than the normal's, or the engine computed
`PROMPT_RATE_SURGE` times the normal's prompt tokens a second) is the traffic, not
a regression: no alert, a log line, and the watcher's `itl_traffic` /
`ttft_traffic` figures say so.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Callable

from zerod.alerts import Alert, AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.registry import AlertRule, owns
from zerod.engine import metrics as names
from zerod.watchers import Watcher
from zerod.watchers.engine_metrics import EngineMetricsWatcher, Sample
from zerod.watchers.latency_baseline import Comparison, LatencyBaseline, Work, load_bucket

log = logging.getLogger("zerod.watchers.latency")

HISTORY = 600
# each statistic as the alert says it (zerod.watchers.latency_baseline: what each is)
STAT_NAMES = {"p99": "p99", "mean": "mean", "sustained": "sustained mean", "cause": "sustained mean"}
RATE_WINDOW_S = 5.0
# prompt tokens computed a second, over the normal's at that load, that explain a latency
# over its normal (LatencyWatcher.prompt_cause; the H200 runs it is set between: docs/daemon.md)
PROMPT_RATE_SURGE = 1.15
# alerts a regression may follow from, besides a new process on the GPU
CAUSE_ALERTS = ("GpuThrottled", "XidError", "PcieReplays", "EccErrors", "GpuHot", "PreflightFailed")


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v * 1000:.1f} ms"


def _concurrency(s: Sample) -> float:
    return s.values.get(names.REQUESTS_RUNNING, 0.0) + s.values.get(names.REQUESTS_WAITING, 0.0)


def _work(a: Sample, b: Sample, first_tokens: float) -> Work:
    """The prompt work of the interval a -> b (an engine that does not export the
    counters: none, and no verdict on it)."""
    def delta(name: str) -> float:
        return max(0.0, b.values.get(name, 0.0) - a.values.get(name, 0.0))
    if names.PROMPT_TOKENS_TOTAL not in b.values:
        return Work()
    return Work(first_tokens, delta(names.PROMPT_TOKENS_TOTAL), delta(names.PREFIX_CACHE_HITS_TOTAL))


@owns(alerts=(AlertRule("LatencyRegression", "warning", "p99 TTFT or ITL above its learned normal for the load "
                        "(or the fixed ceiling); names a foreign process or alert that began just before"),))
class LatencyWatcher(Watcher):
    name = "latency"
    blocking = False

    def __init__(self, book: AlertBook, cfg: DaemonConfig, metrics: EngineMetricsWatcher,
                 recent_foreign: Callable[[], list[dict[str, Any]]] = lambda: [],
                 clock=time.time) -> None:
        super().__init__()
        self.spec = metrics.spec  # the engine it judges: its alert keys, labels and GPUs
        if self.spec.tagged:
            self.name = f"{self.name}:{self.spec.name}"
        self.book = book
        self.cfg = cfg
        self.metrics = metrics
        self.recent_foreign = recent_foreign
        self.clock = clock
        self.interval_s = cfg.watch_interval_s
        self.figures: dict[str, Any] = {
            "ttft_p50_s": None, "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None,
            "ttft_count": 0, "itl_count": 0, "output_tokens_per_s": None,
            # the load now, and the normal p99 at that load (None: not learned yet)
            "load_bucket": None, "itl_normal_p99_s": None, "ttft_normal_p99_s": None,
            # why a latency over its normal raised no alert: the prompts (None: it is not over)
            "itl_traffic": None, "ttft_traffic": None,
        }
        self.history: dict[str, collections.deque] = {k: collections.deque(maxlen=HISTORY) for k in (
            "output_tokens_per_s", "running", "waiting", "kv_pages_used", "itl_p99_s", "ttft_p99_s")}
        self._over_since: dict[str, float] = {}
        self._stat: dict[str, str] = {}   # the statistic a firing regression was named by
        # the history reaches a minute before the oldest cause still judged
        self.baseline = LatencyBaseline(cfg.latency_window_s, cfg.latency_baseline_s,
                                        cfg.cause_window_s + cfg.latency_window_s)
        self._learned_to = -math.inf  # the newest sample filed into the baseline

    async def apoll(self) -> None:
        self.update()

    def update(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        f = self.figures
        win = self.metrics.window(self.cfg.latency_window_s)
        if win is None:
            for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tokens_per_s"):
                f[k] = None
            f["ttft_count"] = f["itl_count"] = 0
        else:
            old, new = win
            ttft, itl = new.ttft.minus(old.ttft), new.itl.minus(old.itl)
            f["ttft_count"], f["itl_count"] = int(ttft.count), int(itl.count)
            f["ttft_p50_s"], f["ttft_p99_s"] = ttft.quantile(0.5), ttft.quantile(0.99)
            f["itl_p50_s"], f["itl_p99_s"] = itl.quantile(0.5), itl.quantile(0.99)
            rate_win = self.metrics.window(RATE_WINDOW_S)
            if rate_win is not None and rate_win[1].t > rate_win[0].t:
                a, b = rate_win
                key = names.GENERATION_TOKENS_TOTAL
                d = b.values.get(key, 0.0) - a.values.get(key, 0.0)
                f["output_tokens_per_s"] = max(0.0, d) / (b.t - a.t)
        last = self.metrics.last
        v = last.values if last else {}
        bucket = load_bucket(_concurrency(last)) if last else None
        f["load_bucket"] = bucket
        for what in ("itl", "ttft"):
            f[f"{what}_normal_p99_s"] = self.baseline.normal(what, bucket).quantile(0.99) if bucket else None
        total, free = v.get(names.KV_PAGES_TOTAL), v.get(names.KV_PAGES_FREE)
        self.history["output_tokens_per_s"].append(f["output_tokens_per_s"])
        self.history["running"].append(v.get(names.REQUESTS_RUNNING))
        self.history["waiting"].append(v.get(names.REQUESTS_WAITING))
        self.history["kv_pages_used"].append(total - free if total is not None and free is not None else None)
        self.history["itl_p99_s"].append(f["itl_p99_s"])
        self.history["ttft_p99_s"].append(f["ttft_p99_s"])
        self._learn()
        self._alerts(now)
        return f

    def _learn(self) -> None:
        """File each new scrape interval's histogram deltas under its load."""
        samples = list(self.metrics.samples)
        for a, b in zip(samples, samples[1:]):
            if b.t <= self._learned_to:
                continue
            ttft, itl = b.ttft.minus(a.ttft), b.itl.minus(a.itl)
            if ttft.count < 0 or itl.count < 0:  # the engine's counters started again
                continue
            # the higher load of the two scrapes: when load rises at once, the interval's
            # latencies (first tokens queued behind the new prefills) belong to the new load
            self.baseline.add(b.t, max(_concurrency(a), _concurrency(b)), {"ttft": ttft, "itl": itl},
                              _work(a, b, ttft.count))
        if samples:
            self._learned_to = samples[-1].t

    def _verdict(self, what: str, now: float) -> tuple[str, dict[str, Any]]:
        """("over", facts) / ("fine", {}) / ("none", {}): too few observations to tell."""
        verdicts = []
        slo = self.cfg.slo_itl_p99_s if what == "itl" else self.cfg.slo_ttft_p99_s
        p99, n = self.figures[f"{what}_p99_s"], self.figures[f"{what}_count"]
        if slo and p99 is not None and n >= self.cfg.latency_min_samples:
            if p99 > slo:
                return "over", {"basis": "slo", "p99": p99, "slo": slo, "count": n}
            verdicts.append("fine")
        factor = self.cfg.latency_regression_factor
        if factor:
            cfg = self.cfg
            # the mean for ITL alone (why: zerod.watchers.latency_baseline)
            stats = (("p99", None), ("mean", cfg.latency_shift_window_s)) if what == "itl" else (("p99", None),)
            comps = [c for stat, recent in stats
                     for c in self.baseline.compare(what, cfg.latency_min_samples, cfg.latency_baseline_min_samples,
                                                    cfg.latency_baseline_min_s, stat=stat, recent_s=recent)]
            if what == "itl" and cfg.latency_sustain_intervals:
                comps += self.baseline.sustained(what, cfg.latency_sustain_intervals, cfg.latency_min_samples,
                                                 cfg.latency_baseline_min_samples, cfg.latency_baseline_min_s)
                comps += self._since_causes(now)
            if comps:
                over = [c for c in comps if c.ratio > factor]
                # the statistic that crossed first names the alert while it holds (its
                # summary changes only with the facts), else the one furthest over
                worst = next((c for c in over if c.stat == self._stat.get(what)), None) or \
                    max(comps, key=lambda c: c.ratio)
                if worst.ratio > factor:
                    self._stat[what] = worst.stat
                    self.baseline.taint(what)  # a regression is not the new normal
                    over_s = cfg.latency_window_s if worst.stat == "p99" else cfg.latency_shift_window_s
                    return "over", {"basis": "cause" if worst.stat == "cause" else "baseline", "stat": worst.stat,
                                    "value": worst.value_s, "normal": worst.normal_s, "bucket": worst.bucket,
                                    "count": worst.count, "ratio": worst.ratio, "factor": factor,
                                    "over_s": over_s, "since": worst.since}
                verdicts.append("fine")
        return ("fine" if verdicts else "none"), {}

    def _alerts(self, now: float) -> None:
        for what in ("itl", "ttft"):
            verdict, v = self._verdict(what, now)
            if verdict != "over":
                self.figures[f"{what}_traffic"] = None
                if verdict == "fine" or self.figures[f"{what}_count"] == 0:
                    self._over_since.pop(what, None)
                    self._stat.pop(what, None)
                    self.book.resolve("LatencyRegression", self.spec.key(what))
                continue
            label = "inter-token latency" if what == "itl" else "time to first token"
            since = self._over_since.get(what, now)
            processes = self.likely_causes(since)
            alerts = self.alert_causes(since, now)
            # a process holding a CUDA context or a host alert that began within a window
            # before the regression outweighs the prompts; an older one, or an NVML reader,
            # is named only when the prompts do not explain it (docs/daemon.md)
            near = since - self.cfg.latency_window_s
            fresh = any(c["first_seen"] >= near and c.get("holds_context", True) for c in processes) \
                or any(a.starts_at >= near for a in alerts)
            traffic = None if fresh else self.prompt_cause(what, v)
            if traffic is not None:
                # the engine had more prompt work than its normal: the traffic, not the host
                # (the watcher's figures and the log say so; nothing an operator can fix)
                if self.figures[f"{what}_traffic"] is None:
                    log.info("engine %s: %s above its normal, explained by the prompts: %s",
                             self.spec.name, label, traffic)
                self.figures[f"{what}_traffic"] = traffic
                self._over_since.pop(what, None)
                self._stat.pop(what, None)
                self.book.resolve("LatencyRegression", self.spec.key(what))
                continue
            self.figures[f"{what}_traffic"] = None
            self._over_since.setdefault(what, now)
            # the summary changes only with the facts (a log line each time); the figures go in the description
            if v["basis"] == "slo":
                summary = f"p99 {label} over its SLO of {_ms(v['slo'])}"
                desc = (f"p50 {_ms(self.figures[f'{what}_p50_s'])}, p99 {_ms(v['p99'])} over the last "
                        f"{self.cfg.latency_window_s:.0f} s ({v['count']} observations)")
            elif v["basis"] == "cause":
                summary = (f"{STAT_NAMES[v['stat']]} {label} over {self.cfg.latency_regression_factor:g}x its "
                           f"{_ms(v['normal'])} of the minute before")
                desc = (f"{STAT_NAMES[v['stat']]} {_ms(v['value'])} in each of the last "
                        f"{self.cfg.latency_sustain_intervals} scrapes (the lowest of them), {v['ratio']:.1f}x "
                        f"its mean over the {self.cfg.latency_window_s:.0f} s before the likely cause began "
                        f"({now - v['since']:.0f} s ago), whatever the load then ({v['count']} observations, "
                        f"{v['bucket']} concurrent requests now)")
            else:
                summary = (f"{STAT_NAMES[v['stat']]} {label} over {self.cfg.latency_regression_factor:g}x its "
                           f"normal {_ms(v['normal'])} at {v['bucket']} concurrent requests")
                over = (f"in each of the last {self.cfg.latency_sustain_intervals} scrapes (the lowest of them)"
                        if v["stat"] == "sustained" else f"over the last {v['over_s']:.0f} s")
                desc = (f"{STAT_NAMES[v['stat']]} {_ms(v['value'])} {over}, {v['ratio']:.1f}x "
                        f"the normal of the last {self.cfg.latency_baseline_s / 60:.0f} min at that load "
                        f"({v['count']} observations at {v['bucket']} concurrent requests)")
            # "slo" names the statistic that fired (itl_p99, itl_mean, itl_sustained, ttft_p99);
            # zerod top marks the metric's row by its prefix
            stat = {"slo": "p99", "cause": "sustained"}.get(v["basis"]) or v["stat"]
            labels: dict[str, Any] = {"slo": f"{what}_{stat}", "basis": v["basis"], "load": v.get("bucket"),
                                      **self.spec.labels}
            if self.spec.tagged:
                summary = f"engine {self.spec.name}: {summary}"
            fix = "look for other load on the GPU (zerod top) and for throttling"
            if processes:
                c = processes[0]
                where = f"unit {c['unit']}" if c.get("unit") else (
                    f"container {c['container']}" if c.get("container") else "no unit")
                ago = since - c["first_seen"]
                when = f"{ago:.0f} s before the regression began" if ago >= 0 else \
                    f"{-ago:.0f} s after the regression began"
                summary += f"; likely cause: {c['name']} (pid {c['pid']}) on GPU {c['gpu'] if c['gpu'] is not None else '?'}"
                desc += (f"; likely cause: {c['name']} (pid {c['pid']}, {where}, command line: "
                         f"{c['cmdline'] or '?'}) started holding the GPU {when}")
                others = [f"{o['name']} (pid {o['pid']})" for o in processes[1:]] + [a.summary for a in alerts]
                if others:
                    desc += "; also: " + ", ".join(others)
                labels.update(gpu=c["gpu"], process=c["name"], cause_pid=c["pid"])
                fix = c.get("fix") or fix
            elif alerts:
                a = alerts[0]
                summary += f"; likely cause: {a.alertname} ({a.summary})"
                desc += "; likely cause: " + "; also: ".join(f"{x.alertname}: {x.summary}" for x in alerts)
                labels.update(cause=a.alertname, gpu=a.labels.get("gpu"))
                fix = a.fix or fix
            else:
                summary += "; no likely cause found"
                desc += (f"; no likely cause found: no new process on the GPU, no throttling, Xid, PCIe replays, "
                         f"ECC errors or failing preflight check within {self.cfg.cause_window_s:.0f} s before "
                         f"it began")
            self.book.fire("LatencyRegression", self.spec.key(what), severity="warning", summary=summary, description=desc,
                           labels=labels, fix=fix)

    def _since_causes(self, now: float) -> list[Comparison]:
        """At a load with no normal yet, ITL since each likely cause began (a foreign
        process holding a CUDA context, a host alert) against the minute before it,
        whatever the load then (LatencyBaseline.since). A cause starts a verdict within
        latency_window_s of its start and holds one it started for cause_window_s. Not
        when the engine computed PROMPT_RATE_SURGE times the prompt tokens a second over
        the intervals compared that it did the minute before: the traffic changed too (a
        slower engine computes fewer)."""
        cfg = self.cfg
        horizon = cfg.cause_window_s if self._stat.get("itl") == "cause" else cfg.latency_window_s
        starts = {c["first_seen"] for c in self.likely_causes(now) if c.get("holds_context", True)}
        starts |= {a.starts_at for a in self.alert_causes(now, now)}
        out = []
        for t in sorted(s for s in starts if now - s <= horizon):
            c = self.baseline.since("itl", t, cfg.latency_window_s, cfg.latency_sustain_intervals,
                                    cfg.latency_min_samples, cfg.latency_baseline_min_samples,
                                    cfg.latency_baseline_min_s)
            if c is None:
                continue
            before = self.baseline.work_between(t - cfg.latency_window_s, t)
            after = self.baseline.last_work(cfg.latency_sustain_intervals)
            r, n = after.computed_per_s, before.computed_per_s
            if r is not None and n and r >= n * PROMPT_RATE_SURGE:
                continue
            out.append(c)
        return out

    def prompt_cause(self, what: str, v: dict[str, Any]) -> str | None:
        """Whether the engine had more prompt work than its normal at that load, enough to
        explain the latency (longer prompts, fewer prefix-cache hits, or more of them):
        - each request of the window needed `latency_regression_factor` times more prompt
          tokens computed than the normal's;
        - or, over the seconds the statistic covers, the engine computed `PROMPT_RATE_SURGE`
          times the normal's prompt tokens a second. Near its capacity every prompt token
          a step takes lengthens the step for all its decodes, so a little more prompt work
          moves ITL a lot; a slower host does the opposite: it computes fewer.
        Only for the learned normal (an SLO has no normal)."""
        if v.get("basis") != "baseline":
            return None
        bucket = v["bucket"]
        normal, window = self.baseline.normal_work(what, bucket), self.baseline.window_work(bucket)
        recent = self.baseline.window_work(bucket, v["over_s"])
        a, b = window.computed_per_request, normal.computed_per_request
        if a is not None and b and window.first_tokens >= self.cfg.latency_min_samples and a >= b * v["factor"]:
            return (f"{a:.0f} prompt tokens computed per request over the window, "
                    f"{a / b:.1f}x the normal's {b:.0f} at that load (prefix-cache hits "
                    f"{window.cached_share:.0%} of prompt tokens, normally {normal.cached_share:.0%})")
        r, n = recent.computed_per_s, normal.computed_per_s
        if r is not None and n and recent.first_tokens >= self.cfg.latency_min_samples and r >= n * PROMPT_RATE_SURGE:
            return (f"{r:.0f} prompt tokens computed a second over the last {v['over_s']:.0f} s, "
                    f"{r / n:.2f}x the normal's {n:.0f} at that load")
        return None

    def likely_causes(self, since: float) -> list[dict[str, Any]]:
        """Foreign processes that appeared within cause_window_s before `since`
        (or at any time since then): those holding a CUDA context or GPU memory
        first (they take SM time; an NVML-only reader does not), newest first."""
        lo = since - self.cfg.cause_window_s
        out = [c for c in self.recent_foreign() if c["first_seen"] >= lo]
        return sorted(out, key=lambda c: (bool(c.get("holds_context", True)), c["first_seen"]), reverse=True)

    def alert_causes(self, since: float, now: float) -> list[Alert]:
        """Throttling, an Xid, PCIe replays, ECC errors, a failing preflight check:
        alerts that began within cause_window_s before `since`, or since then; newest first."""
        lo = since - self.cfg.cause_window_s
        out = [a for a in self.book.all() if a.alertname in CAUSE_ALERTS and lo <= a.starts_at <= now
               and self._on_my_gpus(a)]
        return sorted(out, key=lambda a: a.starts_at, reverse=True)

    def _on_my_gpus(self, a: Alert) -> bool:
        """With [[engines]], a GPU's alert is a cause only for the engine of that GPU."""
        gpu = a.labels.get("gpu")
        return not self.spec.tagged or gpu is None or not gpu.isdigit() or int(gpu) in self.spec.gpus

    def snapshot(self) -> dict[str, Any]:
        return {**self.figures, "history": {k: list(v) for k, v in self.history.items()}}
