"""Engine latency over the last minute, from the engine's histograms.

p50/p99 of TTFT and ITL are computed from the difference of two scrapes a
`latency_window_s` apart (histogram_quantile over bucket deltas, as
Prometheus' `rate()` + `histogram_quantile()` would). `LatencyRegression`
fires when a p99 exceeds its SLO (`slo_itl_p99_s`, `slo_ttft_p99_s`) with at
least `latency_min_samples` observations in the window; when a foreign GPU
process appeared within `cause_window_s` before the regression began (or is
there now), the alert names it as the likely cause — the source document's
incident (a monitoring agent's GPU poll taking P99 from 90 to 320 ms)
diagnosed by the daemon in seconds.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engine import metrics as names
from zerod.watchers import Watcher
from zerod.watchers.engine_metrics import EngineMetricsWatcher

HISTORY = 600
RATE_WINDOW_S = 5.0


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v * 1000:.1f} ms"


class LatencyWatcher(Watcher):
    name = "latency"
    blocking = False

    def __init__(self, book: AlertBook, cfg: DaemonConfig, metrics: EngineMetricsWatcher,
                 recent_foreign: Callable[[], list[dict[str, Any]]] = lambda: [],
                 clock=time.time) -> None:
        super().__init__()
        self.book = book
        self.cfg = cfg
        self.metrics = metrics
        self.recent_foreign = recent_foreign
        self.clock = clock
        self.interval_s = cfg.watch_interval_s
        self.figures: dict[str, Any] = {
            "ttft_p50_s": None, "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None,
            "ttft_count": 0, "itl_count": 0, "output_tokens_per_s": None,
        }
        self.history: dict[str, collections.deque] = {k: collections.deque(maxlen=HISTORY) for k in (
            "output_tokens_per_s", "running", "waiting", "kv_pages_used", "itl_p99_s", "ttft_p99_s")}
        self._over_since: dict[str, float] = {}

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
        total, free = v.get(names.KV_PAGES_TOTAL), v.get(names.KV_PAGES_FREE)
        self.history["output_tokens_per_s"].append(f["output_tokens_per_s"])
        self.history["running"].append(v.get(names.REQUESTS_RUNNING))
        self.history["waiting"].append(v.get(names.REQUESTS_WAITING))
        self.history["kv_pages_used"].append(total - free if total is not None and free is not None else None)
        self.history["itl_p99_s"].append(f["itl_p99_s"])
        self.history["ttft_p99_s"].append(f["ttft_p99_s"])
        self._alerts(now)
        return f

    def _alerts(self, now: float) -> None:
        for what, slo in (("itl", self.cfg.slo_itl_p99_s), ("ttft", self.cfg.slo_ttft_p99_s)):
            p99 = self.figures[f"{what}_p99_s"]
            n = self.figures[f"{what}_count"]
            if not slo or p99 is None or n < self.cfg.latency_min_samples:
                if not slo or n == 0:
                    self._over_since.pop(what, None)
                    self.book.resolve("LatencyRegression", what)
                continue
            if p99 <= slo:
                self._over_since.pop(what, None)
                self.book.resolve("LatencyRegression", what)
                continue
            since = self._over_since.setdefault(what, now)
            causes = self.likely_causes(since)
            label = "inter-token latency" if what == "itl" else "time to first token"
            summary = f"p99 {label} {_ms(p99)} over the last {self.cfg.latency_window_s:.0f} s (SLO {_ms(slo)})"
            desc = f"p50 {_ms(self.figures[f'{what}_p50_s'])}, p99 {_ms(p99)} over {n} observations"
            fix = None
            if causes:
                c = causes[0]
                where = f"unit {c['unit']}" if c.get("unit") else (
                    f"container {c['container']}" if c.get("container") else "no unit")
                ago = since - c["first_seen"]
                when = f"{ago:.0f} s before the regression began" if ago >= 0 else \
                    f"{-ago:.0f} s after the regression began"
                summary += f"; likely cause: {c['name']} (pid {c['pid']}) on GPU {c['gpu'] if c['gpu'] is not None else '?'}"
                desc += (f"; likely cause: {c['name']} (pid {c['pid']}, {where}, command line: "
                         f"{c['cmdline'] or '?'}) started holding the GPU {when}")
                if len(causes) > 1:
                    desc += "; also: " + ", ".join(f"{o['name']} (pid {o['pid']})" for o in causes[1:])
                fix = c.get("fix")
            self.book.fire("LatencyRegression", what, severity="warning", summary=summary, description=desc,
                           labels={"slo": f"{what}_p99", **({"gpu": causes[0]["gpu"], "process": causes[0]["name"],
                                                             "cause_pid": causes[0]["pid"]} if causes else {})},
                           fix=fix or "look for other load on the GPU (zerod top) and for throttling")

    def likely_causes(self, since: float) -> list[dict[str, Any]]:
        """Foreign processes that appeared within cause_window_s before `since`
        (or at any time since then), newest first."""
        lo = since - self.cfg.cause_window_s
        out = [c for c in self.recent_foreign() if c["first_seen"] >= lo]
        return sorted(out, key=lambda c: c["first_seen"], reverse=True)

    def snapshot(self) -> dict[str, Any]:
        return {**self.figures, "history": {k: list(v) for k, v in self.history.items()}}
