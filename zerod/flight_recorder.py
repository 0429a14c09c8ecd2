"""The daemon's memory: every alert transition and lifecycle event into the
event store (zerod.event_store), and on a critical alert a support bundle
(zerod.bundle) under `state_dir/bundles`, at most one per alert name per
`bundle_min_interval_s` (a critical alert at start does not use up the next one's),
the newest `bundles_kept` kept. A store that cannot be opened is logged once
and the daemon runs without it: memory is never a reason not to serve.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from typing import Any, Callable

from zerod.alerts import Alert, AlertBook
from zerod.bundle import write_bundle
from zerod.daemon_config import DaemonConfig
from zerod.event_store import EventStore, EventStoreError, store_path

log = logging.getLogger("zerod.events")

BUNDLE_DIR = "bundles"


def bundle_name(t: float, alertname: str) -> str:
    return time.strftime("zerod-bundle-%Y%m%dT%H%M%SZ", time.gmtime(t)) + f"-{alertname}.tar.gz"


class FlightRecorder:
    def __init__(self, cfg: DaemonConfig, config: dict[str, Any], book: AlertBook,
                 daemon_docs: Callable[[], dict[str, Any]] | None = None, clock=time.time) -> None:
        self.cfg = cfg
        self.config = config
        self.clock = clock
        self.daemon_docs = daemon_docs
        self.bundle_dir = os.path.join(cfg.state_dir, BUNDLE_DIR)
        self.last_bundle_at: dict[str, float] = {}  # alert name -> when its last bundle began
        self.bundles_written: list[str] = []
        self._writing: threading.Thread | None = None
        try:
            self.store: EventStore | None = EventStore(store_path(cfg.state_dir), cfg.events_max_age_s,
                                                       cfg.events_max_bytes, clock=clock)
            self.store.prune()
        except EventStoreError as exc:
            log.warning("%s: events are not kept (set [daemon] state_dir to a writable directory)", exc)
            self.store = None
        book.add_transition_listener(self.on_transition)

    def lifecycle(self, what: str, state: str, summary: str, severity: str = "info", **labels: Any) -> None:
        if self.store is not None:
            self._safe(self.store.record_daemon, what, state, summary, severity, labels)

    def on_transition(self, alert: Alert, state: str) -> None:
        if self.store is not None:
            self._safe(self.store.record_alert, alert, state)
        if state == "firing" and alert.severity == "critical" and self.cfg.bundle_on_critical:
            self.maybe_bundle(alert.alertname)

    def maybe_bundle(self, reason: str) -> str | None:
        """Start writing a bundle in a thread unless one was written within the interval."""
        now = self.clock()
        last = self.last_bundle_at.get(reason)
        if last is not None and now - last < self.cfg.bundle_min_interval_s:
            return None
        if self._writing is not None and self._writing.is_alive():
            return None
        self.last_bundle_at[reason] = now
        path = os.path.join(self.bundle_dir, bundle_name(now, reason))
        self._writing = threading.Thread(target=self._write, args=(path, reason), name="zerod-bundle", daemon=True)
        self._writing.start()
        return path

    def _write(self, path: str, reason: str) -> None:
        try:
            docs = self.daemon_docs
            write_bundle(path, self.config, self.cfg.state_dir, daemon_docs=docs, reason=f"critical alert {reason}",
                         clock=self.clock)
        except Exception as exc:  # noqa: BLE001 - a bundle is best effort
            log.warning("flight recorder: cannot write %s: %s", path, exc)
            return
        self.bundles_written.append(path)
        log.warning("flight recorder: %s written (critical alert %s)", path, reason)
        self.lifecycle("BundleWritten", "written", f"support bundle {path} (critical alert {reason})", path=path)
        for old in sorted(glob.glob(os.path.join(self.bundle_dir, "zerod-bundle-*.tar.gz")))[:-self.cfg.bundles_kept]:
            try:
                os.unlink(old)
            except OSError:
                pass

    def wait(self, timeout: float = 60.0) -> None:
        """Until a bundle being written is done (tests, shutdown)."""
        if self._writing is not None:
            self._writing.join(timeout)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    @staticmethod
    def _safe(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a full disk must not break a watcher
            log.warning("event store: %s", exc)
