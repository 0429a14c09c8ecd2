"""XID errors as NVML delivers them: a thread blocked in nvmlEventSetWait.

Each event raises `XidError` naming the XID, its meaning and the action (the
table of zerod.checks.xid, shared with doctor), held for
`counter_alert_hold_s` after the last one. The watcher's own poll only checks
the thread and expires old alerts; the thread wakes every `wait_ms` to see
whether it should stop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily

from zerod.alerts import AlertBook
from zerod.registry import AlertRule, owns
from zerod.daemon_config import DaemonConfig
from zerod.watchers import Watcher
from zerod.checks.gpu_reading import error_value, is_not_supported
from zerod.watchers.nvml_session import NvmlSession

log = logging.getLogger("zerod.xid")

EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
NVML_ERROR_TIMEOUT = 10


def describe_xid(code: int):
    try:
        from zerod.checks.xid import describe
    except ImportError:  # pragma: no cover - checks room missing
        from collections import namedtuple

        return namedtuple("Xid", "meaning critical action")("Xid", True, "see NVIDIA's Xid catalogue")
    return describe(code)


XID_EVENTS = "zerod_gpu_xid_events"


@owns(metrics=(XID_EVENTS,),
      alerts=(AlertRule("XidError", "critical", "an Xid event from NVML, per GPU and Xid, with its meaning and action "
                        "(the table of `zerod.checks.xid`, shared with doctor); a benign Xid fires as a warning"),))
class XidWatcher(Watcher):
    name = "xid_events"
    blocking = False

    def __init__(self, session: NvmlSession, book: AlertBook, cfg: DaemonConfig,
                 wait_ms: int = 2000, clock=time.time) -> None:
        super().__init__()
        self.session = session
        self.book = book
        self.cfg = cfg
        self.wait_ms = wait_ms
        self.interval_s = max(cfg.watch_interval_s, 1.0)
        self.clock = clock
        self.counts: dict[int, dict[str, int]] = {}  # gpu -> {xid: n}
        self.last_event_at: dict[tuple[int, int], float] = {}
        self.supported: bool | None = None
        self.note: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._generation = -1
        self._lock = threading.Lock()

    async def apoll(self) -> None:
        self.check()

    def snapshot(self) -> dict[int, dict[str, int]]:
        """{gpu index: {xid: events since the daemon started}}."""
        with self._lock:
            return {gpu: dict(c) for gpu, c in self.counts.items()}

    def collect(self):
        fam = CounterMetricFamily(XID_EVENTS, "XID events received from NVML since the daemon started.",
                                  labels=["gpu", "uuid", "xid"])
        for gpu, counts in sorted(self.snapshot().items()):
            dev = self.session.device(gpu)
            if dev is None:  # an event NVML could not place on a GPU: the alert says it
                continue
            for code, n in sorted(counts.items()):
                fam.add_metric([str(gpu), dev.uuid, code], float(n))
        yield fam

    def check(self) -> None:
        """Start the event thread when NVML is up (again); expire old alerts."""
        if self.session.ok and self._generation != self.session.generation and not self._stop.is_set():
            self._generation = self.session.generation
            self._thread = threading.Thread(target=self._run, name="zerod-xid", daemon=True)
            self._thread.start()
        now = self.clock()
        with self._lock:
            expired = [k for k, t in self.last_event_at.items() if now - t >= self.cfg.counter_alert_hold_s]
            for k in expired:
                del self.last_event_at[k]
        for gpu, xid in expired:
            self.book.resolve("XidError", f"{gpu}:{xid}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_ms / 1000 + 1)

    def _run(self) -> None:
        N = self.session.nvml
        generation = self._generation
        try:
            es = N.nvmlEventSetCreate()
        except Exception as exc:
            self.supported, self.note = False, f"nvmlEventSetCreate failed: {exc}"
            log.warning("XID events not watched: %s", self.note)
            return
        registered = 0
        for dev in self.session.devices:
            try:
                N.nvmlDeviceRegisterEvents(dev.handle, EVENT_XID_CRITICAL, es)
                registered += 1
            except Exception as exc:
                log.warning("GPU %d: XID events not available (%s)", dev.index,
                            "not supported" if is_not_supported(exc) else exc)
        self.supported = registered > 0
        if not registered:
            self.note = "no GPU accepts XID event registration"
            return
        log.info("watching XID events on %d GPU(s)", registered)
        try:
            while not self._stop.is_set() and self.session.ok and self.session.generation == generation:
                try:
                    data = N.nvmlEventSetWait_v2(es, self.wait_ms)
                except Exception as exc:
                    if error_value(exc) == NVML_ERROR_TIMEOUT:
                        continue
                    if self._stop.is_set():
                        break
                    log.warning("nvmlEventSetWait failed: %s", exc)
                    time.sleep(self.wait_ms / 1000)
                    continue
                self.record(self._index_of(N, data), int(data.eventData))
        finally:
            try:
                N.nvmlEventSetFree(es)
            except Exception:
                pass

    def _index_of(self, N: Any, data: Any) -> int:
        try:
            return int(N.nvmlDeviceGetIndex(data.device))
        except Exception:
            return -1

    def record(self, gpu: int, xid: int) -> None:
        """One XID event: count it and raise the alert (called from the thread)."""
        info = describe_xid(xid)
        with self._lock:
            c = self.counts.setdefault(gpu, {})
            c[str(xid)] = c.get(str(xid), 0) + 1
            self.last_event_at[(gpu, xid)] = self.clock()
            counts = dict(c)
        dev = self.session.device(gpu)
        self.book.fire("XidError", f"{gpu}:{xid}", severity="critical" if info.critical else "warning",
                       summary=f"GPU {gpu}: Xid {xid} ({info.meaning})",
                       description=f"NVML reported Xid {xid} on GPU {gpu}: {info.meaning}; "
                                   f"{counts[str(xid)]} of this Xid since the daemon started",
                       labels={"gpu": gpu, "uuid": dev.uuid if dev else None, "xid": xid},
                       fix=info.action)
