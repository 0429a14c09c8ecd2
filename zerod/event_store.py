"""Events that last: every alert transition and daemon lifecycle event, in SQLite
under `[daemon] state_dir`, so `zerod events` answers "what happened on this host
last night" after a restart, and with the daemon down.

One row per event: its time, its kind ("alert" or "daemon"), its alertname (for a
daemon event, what happened: DaemonStarted, EngineStarted …), its state (firing,
resolved; started, ready, stopped …), severity, engine, summary, labels (JSON).
Retention: rows older than `events_max_age_s` go, then the oldest until the data
fits `events_max_bytes` (incremental vacuum gives the pages back to the disk).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("zerod.events")

FILE_NAME = "events.sqlite3"
DEFAULT_ENGINE = "default"  # zerod.fleet's name for the [engine] engine
PRUNE_EVERY = 100  # events between two retention passes
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    t REAL NOT NULL,
    kind TEXT NOT NULL,
    alertname TEXT NOT NULL,
    state TEXT NOT NULL,
    severity TEXT NOT NULL,
    engine TEXT,
    summary TEXT NOT NULL,
    description TEXT,
    labels TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_t ON events (t);
"""


class EventStoreError(OSError):
    """The store cannot be opened or read; the message says where and why."""


def store_path(state_dir: str) -> str:
    return os.path.join(state_dir, FILE_NAME)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


class EventStore:
    def __init__(self, path: str, max_age_s: float = 30 * 86400.0, max_bytes: int = 64 << 20,
                 clock=time.time, create: bool = True) -> None:
        self.path = path
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._since_prune = 0
        if not create and not os.path.exists(path):
            raise EventStoreError(f"no event store at {path} (the daemon has not run with this state_dir)")
        try:
            if create:
                os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
            uri = f"file:{path}" + ("" if create else "?mode=ro")
            self.db = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=5.0)
            if create:
                # before the first table: incremental vacuum needs it set on an empty file
                self.db.execute("PRAGMA auto_vacuum = INCREMENTAL")
                self.db.execute("PRAGMA journal_mode = WAL")
                # WAL with NORMAL: never corrupt, one fsync per checkpoint instead of per alert
                self.db.execute("PRAGMA synchronous = NORMAL")
                self.db.executescript(SCHEMA)
                self.db.commit()
        except (OSError, sqlite3.Error) as exc:
            raise EventStoreError(f"cannot open the event store {path}: {exc}") from None

    @classmethod
    def for_reading(cls, state_dir: str) -> "EventStore":
        return cls(store_path(state_dir), create=False)

    # --- writing -----------------------------------------------------------------
    def record(self, kind: str, alertname: str, state: str, severity: str, summary: str,
               labels: dict[str, Any] | None = None, description: str = "", t: float | None = None) -> None:
        labels = {k: str(v) for k, v in (labels or {}).items()}
        row = (self.clock() if t is None else t, kind, alertname, state, severity, labels.get("engine"),
               summary, description, json.dumps(labels, sort_keys=True))
        with self._lock:
            self.db.execute("INSERT INTO events (t, kind, alertname, state, severity, engine, summary, "
                            "description, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            self.db.commit()
            self._since_prune += 1
            if self._since_prune >= PRUNE_EVERY:
                self._prune()

    def record_alert(self, alert, state: str) -> None:
        """An AlertBook transition (its transition listener)."""
        self.record("alert", alert.alertname, state, alert.severity, alert.summary,
                    {"id": alert.id, **alert.labels}, alert.description if state == "firing" else "")

    def record_daemon(self, what: str, state: str, summary: str, severity: str = "info",
                      labels: dict[str, Any] | None = None) -> None:
        self.record("daemon", what, state, severity, summary, labels)

    def prune(self) -> int:
        with self._lock:
            return self._prune()

    def _prune(self) -> int:
        """Drop by age, then the oldest while the data is over the size; rows dropped."""
        self._since_prune = 0
        cur = self.db.execute("DELETE FROM events WHERE t < ?", (self.clock() - self.max_age_s,))
        dropped = cur.rowcount
        while self._data_bytes() > self.max_bytes:
            n = self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
            if n == 0:
                break
            cur = self.db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY t, id LIMIT ?)",
                                  (max(1, n // 10),))
            dropped += cur.rowcount
            self.db.commit()
            self.db.execute("PRAGMA incremental_vacuum")
        self.db.commit()
        self.db.execute("PRAGMA incremental_vacuum")
        return dropped

    def _data_bytes(self) -> int:
        pages = self.db.execute("PRAGMA page_count").fetchone()[0]
        free = self.db.execute("PRAGMA freelist_count").fetchone()[0]
        size = self.db.execute("PRAGMA page_size").fetchone()[0]
        return (pages - free) * size

    # --- reading -----------------------------------------------------------------
    def query(self, since: float | None = None, severities: tuple[str, ...] = (),
              engine: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Oldest first: {time, t, kind, alertname, state, severity, engine, summary, description, labels}."""
        where, args = [], []
        if since is not None:
            where.append("t >= ?")
            args.append(since)
        if severities:
            where.append(f"severity IN ({', '.join('?' * len(severities))})")
            args.extend(severities)
        if engine is not None:
            # the one [engine] engine's events carry no engine label
            where.append("(engine = ? OR engine IS NULL)" if engine == DEFAULT_ENGINE else "engine = ?")
            args.append(engine)
        sql = ("SELECT t, kind, alertname, state, severity, engine, summary, description, labels FROM events"
               + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY t, id")
        if limit is not None:
            sql = f"SELECT * FROM ({sql.replace(' ORDER BY t, id', ' ORDER BY t DESC, id DESC')} LIMIT {int(limit)}) " \
                  f"ORDER BY t"
        try:
            with self._lock:
                rows = self.db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise EventStoreError(f"cannot read the event store {self.path}: {exc}") from None
        return [{"time": iso(t), "t": t, "kind": kind, "alertname": name, "state": state, "severity": sev,
                 "engine": eng, "summary": summary, "description": desc or "", "labels": json.loads(labels)}
                for t, kind, name, state, sev, eng, summary, desc, labels in rows]

    def close(self) -> None:
        with self._lock:
            self.db.close()
