"""One log format for the engine (`zerod serve`) and the daemon that supervises it.

The engine owns it because the engine imports nothing of the daemon, while the
daemon may import the engine's shared parts: one journal, one format.

Under systemd (stderr is the journal, `$JOURNAL_STREAM` set) each line is
`<N>logger: message`: journald reads the `<N>` prefix as the priority
(SyslogLevelPrefix=, on by default) and adds the time itself. On a terminal:
`time LEVEL logger: message`.
"""

from __future__ import annotations

import logging
import os
import sys

SYSLOG_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
TERMINAL_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"


class JournalFormatter(logging.Formatter):
    """Every line of a record (a multi-line message, a traceback) carries the priority."""

    def format(self, record: logging.LogRecord) -> str:
        prio = SYSLOG_PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines()) or f"<{prio}>"


def formatter() -> logging.Formatter:
    if os.environ.get("JOURNAL_STREAM"):
        return JournalFormatter(JOURNAL_FORMAT)
    return logging.Formatter(TERMINAL_FORMAT)


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
