"""WATCHDOG=1 only while the watch loop makes progress: a watcher that stops
(stuck in NVML, say) withholds it, and it comes back when the watcher does."""

from __future__ import annotations

import asyncio
import time

from zerod.daemon import Daemon
from zerod.watchers import Watcher


class Recorder:
    """The notifier's interface, recording what would be sent."""

    enabled = True
    watchdog_enabled = True
    watchdog_usec = 400_000

    def __init__(self):
        self.sent: list[str] = []

    def watchdog(self):
        self.sent.append("WATCHDOG=1")

    def status(self, text):
        self.sent.append("STATUS=" + text)


class W(Watcher):
    name = "w"
    interval_s = 0.1


async def test_watchdog_is_withheld_while_a_watcher_is_stuck(caplog):
    n = Recorder()
    d = Daemon({"daemon": {"metrics_port": -1}, "engine": {}, "doctor": {}, "alerts": {}}, notifier=n)
    w = W()
    w.last_run_at = time.monotonic()
    d.watchers = [w]
    d._stop = asyncio.Event()
    tick = asyncio.create_task(d._tick())
    try:
        await asyncio.sleep(0.5)
        assert n.sent.count("WATCHDOG=1") >= 2  # every WatchdogSec/2
        # the watcher stops making progress: its allowance is max(3 x interval, 10 s)
        w.last_run_at = time.monotonic() - 11
        await asyncio.sleep(0.1)
        before = n.sent.count("WATCHDOG=1")
        await asyncio.sleep(0.6)
        assert n.sent.count("WATCHDOG=1") == before
        assert any("withholding WATCHDOG=1: watcher w made no progress" in r.message for r in caplog.records)
        # it moves again
        w.last_run_at = time.monotonic()
        await asyncio.sleep(0.5)
        assert n.sent.count("WATCHDOG=1") > before
        # stopping: no more pings
        d._stop.set()
        await asyncio.sleep(0.1)
        after = n.sent.count("WATCHDOG=1")
        w.last_run_at = time.monotonic()
        await asyncio.sleep(0.5)
        assert n.sent.count("WATCHDOG=1") == after
    finally:
        tick.cancel()
        await asyncio.gather(tick, return_exceptions=True)
