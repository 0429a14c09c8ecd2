"""The daemon's watchers, one concern per module (node_exporter's habit).

Each watcher polls on its own interval and keeps a cached snapshot; its
`collect()` turns that snapshot into its own Prometheus series at scrape time
(node_exporter's collectors), and zerod.views builds the control API's
documents from the snapshots: neither reads the host.
`poll()` may block (NVML, /proc): the daemon runs it in a worker thread, so the
event loop (control API, /metrics) never waits on it. A watcher that raises is
logged and counted, and runs again at its next tick: nothing a watcher meets
stops the daemon.
"""

from __future__ import annotations

import time


class Watcher:
    name = "watcher"
    interval_s = 1.0
    blocking = True  # poll() runs in a worker thread; False: apoll() on the loop
    delay_first = False  # True: the first poll waits one interval

    def __init__(self) -> None:
        self.runs = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_run_at: float | None = None  # time.monotonic()
        self.busy_s = 0.0  # wall time spent polling, all runs together

    def poll(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def apoll(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def progressed_within(self, seconds: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.last_run_at is not None and now - self.last_run_at <= seconds

    def stats(self) -> dict:
        return {"runs": self.runs, "errors": self.errors, "last_error": self.last_error,
                "busy_s": round(self.busy_s, 4), "interval_s": self.interval_s}
