"""One log format for the engine (`zerod serve`) and the daemon that supervises it.

The engine owns it because the engine imports nothing of the daemon, while the
daemon may import the engine's shared parts: one journal, one format.

Under systemd (`$JOURNAL_STREAM` set and journald's socket there) each record goes to
the journal over its native protocol: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, the logger,
and a record's structured fields (an alert's name, state, severity and labels: the
`fields` extra) each as a journal field, so `journalctl ALERT=XidError` finds them.
Where the socket cannot be reached, each stderr line is `<N>logger: message`: journald
reads the `<N>` prefix as the priority (SyslogLevelPrefix=, on by default). On a
terminal: `time LEVEL logger: message`. `--log-format json` makes each line (or each
journal MESSAGE) one JSON object: time, level, logger, message and the fields.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import sys
import time
from typing import Any

SYSLOG_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
TERMINAL_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"
JOURNAL_SOCKET = "/run/systemd/journal/socket"
LOG_FORMATS = ("text", "json")
FIELDS = "fields"  # the `extra` key of a record's structured fields


class JournalFormatter(logging.Formatter):
    """Every line of a record (a multi-line message, a traceback) carries the priority."""

    def format(self, record: logging.LogRecord) -> str:
        prio = SYSLOG_PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines()) or f"<{prio}>"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601, UTC), level, logger, message, fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage()}
        out.update(getattr(record, FIELDS, None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class JournalHandler(logging.Handler):
    """journald's native protocol: one datagram of FIELD=value entries per record
    (a value with a newline in its binary framing). A record the socket refuses goes
    to stderr in the `<N>` form instead, so nothing is lost."""

    def __init__(self, identifier: str, path: str = JOURNAL_SOCKET) -> None:
        super().__init__()
        self.identifier = identifier
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.fallback = logging.StreamHandler(sys.stderr)
        self.fallback.setFormatter(JournalFormatter(JOURNAL_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sock.sendto(journal_entry(record, self.format(record), self.identifier), self.path)
        except OSError:
            self.fallback.emit(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


def journal_entry(record: logging.LogRecord, message: str, identifier: str) -> bytes:
    fields: dict[str, Any] = {
        "MESSAGE": message, "PRIORITY": SYSLOG_PRIORITY.get(record.levelno, 6),
        "SYSLOG_IDENTIFIER": identifier, "LOGGER": record.name}
    for key, value in (getattr(record, FIELDS, None) or {}).items():
        fields.setdefault(journal_field_name(key), value)
    out = bytearray()
    for key, value in fields.items():
        data = str(value).encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def journal_field_name(key: str) -> str:
    """journald's rule: upper-case letters, digits and underscores, not first a digit
    or an underscore."""
    name = re.sub(r"[^A-Z0-9_]", "_", key.upper()).lstrip("_")
    return ("F" + name if name[:1].isdigit() else name) or "FIELD"


def formatter(log_format: str = "text") -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if os.environ.get("JOURNAL_STREAM"):
        return JournalFormatter(JOURNAL_FORMAT)
    return logging.Formatter(TERMINAL_FORMAT)


def setup_logging(level: str = "info", log_format: str = "text", identifier: str = "zerod") -> None:
    if os.environ.get("JOURNAL_STREAM") and os.path.exists(JOURNAL_SOCKET):
        handler: logging.Handler = JournalHandler(identifier)
        handler.setFormatter(JsonFormatter() if log_format == "json"
                             else logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
