"""Alerts: one state machine, three outputs.

Watchers say what is wrong *now* (`fire`, or `sync` with the whole set of one
alert name); the book turns that into transitions firing -> resolved, each
written once as a structured log line (journald-friendly logfmt), counted for
`zerod_alerts_firing{alertname}`, kept for the control API (resolved ones for
an hour), and pushed to Alertmanager when one is configured (POST
/api/v2/alerts, re-sent while active, resolved with endsAt).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from prometheus_client.core import GaugeMetricFamily

from zerod.registry import SEVERITIES, alert_names, owns
from zerod.engine.logs import FIELDS

log = logging.getLogger("zerod.alerts")

ALERTS_FIRING = "zerod_alerts_firing"


@dataclass
class Alert:
    alertname: str
    key: str
    severity: str
    summary: str
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    fix: str | None = None
    starts_at: float = 0.0
    ends_at: float | None = None
    updated_at: float = 0.0
    delivered: bool = False  # resolved state delivered to Alertmanager

    @property
    def id(self) -> str:
        return f"{self.alertname}/{self.key}" if self.key else self.alertname

    @property
    def state(self) -> str:
        return "firing" if self.ends_at is None else "resolved"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "alertname": self.alertname, "severity": self.severity,
            "state": self.state, "summary": self.summary, "description": self.description,
            "labels": dict(self.labels), "fix": self.fix,
            "starts_at": self.starts_at, "ends_at": self.ends_at,
        }


def logfmt(fields: dict[str, Any]) -> str:
    out = []
    for k, v in fields.items():
        if v is None:
            continue
        s = str(v).replace("\n", " ")
        if s == "" or any(c in s for c in ' ="\\'):
            s = '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
        out.append(f"{k}={s}")
    return " ".join(out)


@owns(metrics=(ALERTS_FIRING,))
class AlertBook:
    def __init__(self, retention_s: float = 3600.0, clock: Callable[[], float] = time.time,
                 log_resolved: bool = True) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, Alert] = {}
        self._resolved: list[Alert] = []
        self.retention_s = retention_s
        self.clock = clock
        self.log_resolved = log_resolved
        self._listeners: list[Callable[[], None]] = []
        self._transition_listeners: list[Callable[[Alert, str], None]] = []

    # --- what watchers call -------------------------------------------------
    def fire(self, alertname: str, key: str = "", *, severity: str = "warning", summary: str,
             description: str = "", labels: dict[str, Any] | None = None,
             fix: str | None = None) -> Alert:
        if severity not in SEVERITIES:
            raise ValueError(f"severity {severity!r}")
        now = self.clock()
        labels = {k: str(v) for k, v in (labels or {}).items() if v is not None}
        aid = f"{alertname}/{key}" if key else alertname
        with self._lock:
            a = self._active.get(aid)
            if a is not None:
                changed = (a.summary, a.severity) != (summary, severity)
                a.summary, a.description, a.labels, a.fix, a.severity = summary, description, labels, fix, severity
                a.updated_at = now
                if not changed:
                    return a
            else:
                a = Alert(alertname, key, severity, summary, description, labels, fix,
                          starts_at=now, updated_at=now)
                self._active[aid] = a
        self._log(a, "firing")
        self._transition(a, "firing")
        self._changed()
        return a

    def resolve(self, alertname: str, key: str = "") -> Alert | None:
        aid = f"{alertname}/{key}" if key else alertname
        with self._lock:
            a = self._active.pop(aid, None)
            if a is None:
                return None
            a.ends_at = self.clock()
            self._resolved.append(a)
        if self.log_resolved:
            self._log(a, "resolved")
        self._transition(a, "resolved")
        self._changed()
        return a

    def sync(self, alertname: str, current: dict[str, dict[str, Any]]) -> None:
        """`current` = every condition of this alert name that holds now,
        {key: fire() kwargs}; the others of that name are resolved."""
        for key, kwargs in current.items():
            self.fire(alertname, key, **kwargs)
        for a in self.firing(alertname):
            if a.key not in current:
                self.resolve(alertname, a.key)

    # --- what outputs read --------------------------------------------------
    def firing(self, alertname: str | None = None) -> list[Alert]:
        with self._lock:
            return [a for a in self._active.values() if alertname is None or a.alertname == alertname]

    def get(self, alertname: str, key: str = "") -> Alert | None:
        with self._lock:
            return self._active.get(f"{alertname}/{key}" if key else alertname)

    def firing_counts(self) -> dict[str, int]:
        counts = {n: 0 for n in alert_names()}
        for a in self.firing():
            counts[a.alertname] = counts.get(a.alertname, 0) + 1
        return counts

    def collect(self):
        fam = GaugeMetricFamily(ALERTS_FIRING, "Alerts firing now, by name.", labels=["alertname"])
        for name, n in sorted(self.firing_counts().items()):
            fam.add_metric([name], float(n))
        yield fam

    def all(self) -> list[Alert]:
        """Firing and resolved (within retention), newest first."""
        now = self.clock()
        with self._lock:
            self._resolved = [a for a in self._resolved if now - (a.ends_at or now) <= self.retention_s]
            items = list(self._active.values()) + list(self._resolved)
        return sorted(items, key=lambda a: a.ends_at or a.starts_at, reverse=True)

    def undelivered_resolved(self) -> list[Alert]:
        with self._lock:
            return [a for a in self._resolved if not a.delivered]

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def add_transition_listener(self, fn: Callable[[Alert, str], None]) -> None:
        """fn(alert, "firing" | "resolved") on each transition the log shows (the event
        store, the flight recorder); called on the watcher's thread."""
        self._transition_listeners.append(fn)

    # --- internals ----------------------------------------------------------
    def _transition(self, a: Alert, state: str) -> None:
        for fn in list(self._transition_listeners):
            try:
                fn(a, state)
            except Exception:  # a broken listener must not break a watcher
                log.exception("alert transition listener failed")

    def _changed(self) -> None:
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:  # a broken listener must not break a watcher
                log.exception("alert listener failed")

    def _log(self, a: Alert, state: str) -> None:
        level = logging.INFO if state == "resolved" else (
            logging.CRITICAL if a.severity == "critical" else
            logging.WARNING if a.severity == "warning" else logging.INFO)
        fields: dict[str, Any] = {"alert": a.alertname, "state": state, "severity": a.severity,
                                  "id": a.id, "summary": a.summary}
        fields.update({f"label_{k}": v for k, v in a.labels.items()})
        if state == "firing":
            if a.description:
                fields["description"] = a.description
            if a.fix:
                fields["fix"] = a.fix
        log.log(level, logfmt(fields), extra={FIELDS: fields})  # journal / JSON fields too


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


class AlertmanagerPusher:
    """Pushes the book to Alertmanager: at once on a change, again every
    `resend_interval_s` while anything fires; resolved alerts go with their
    endsAt until one push succeeds."""

    def __init__(self, book: AlertBook, url: str, resend_interval_s: float = 60.0,
                 timeout_s: float = 5.0, extra_labels: dict[str, str] | None = None,
                 instance: str | None = None) -> None:
        self.book = book
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.resend_interval_s = resend_interval_s
        self.timeout_s = timeout_s
        self.extra_labels = dict(extra_labels or {})
        self.instance = instance or socket.gethostname()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pushes = 0
        self.errors = 0
        self.last_error: str | None = None
        book.add_listener(self._on_change)

    def _on_change(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def payload(self, alerts: list[Alert], now: float) -> list[dict[str, Any]]:
        out = []
        for a in alerts:
            labels = {"alertname": a.alertname, "severity": a.severity, "instance": self.instance,
                      "job": "zerod", **self.extra_labels, **a.labels}
            if a.key:
                labels["zerod_id"] = a.id
            ends = a.ends_at if a.ends_at is not None else now + 4 * self.resend_interval_s
            ann = {"summary": a.summary}
            if a.description:
                ann["description"] = a.description
            if a.fix:
                ann["fix"] = a.fix
            out.append({"labels": labels, "annotations": ann, "startsAt": _iso(a.starts_at),
                        "endsAt": _iso(ends)})
        return out

    async def push_once(self, session) -> bool:
        import aiohttp

        now = self.book.clock()
        firing = self.book.firing()
        resolved = self.book.undelivered_resolved()
        if not firing and not resolved:
            return True
        body = self.payload(firing + resolved, now)
        try:
            async with session.post(self.url, json=body,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status >= 300:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        except Exception as exc:  # network, HTTP: keep trying, never crash
            self.errors += 1
            if self.last_error != str(exc):
                log.warning("alertmanager push to %s failed: %s", self.url, exc)
            self.last_error = str(exc)
            return False
        self.pushes += 1
        self.last_error = None
        for a in resolved:
            a.delivered = True
        return True

    async def run(self) -> None:
        import aiohttp

        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            while True:
                ok = await self.push_once(session)
                self._wake.clear()
                delay = self.resend_interval_s if ok else min(5.0, self.resend_interval_s)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
