"""systemd's notify protocol (sd_notify(3)), implemented in a few lines.

One datagram of newline-separated `KEY=value` lines to the AF_UNIX socket named
by $NOTIFY_SOCKET: a path, or an abstract name written with a leading `@`.
Nothing here fails the caller: without $NOTIFY_SOCKET (not started by systemd)
every call is a no-op, and a send error is logged once and otherwise ignored.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger("zerod.sdnotify")


def socket_address(value: str) -> str | bytes:
    """$NOTIFY_SOCKET as an address for socket.sendto: `@name` is the abstract
    name `\\0name`; anything else is a filesystem path."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False
        self.watchdog_usec = 0
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        if usec and (not wpid or wpid == str(os.getpid())):
            try:
                self.watchdog_usec = max(0, int(usec))
            except ValueError:
                self.watchdog_usec = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_enabled(self) -> bool:
        return self.enabled and self.watchdog_usec > 0

    def notify(self, **fields: object) -> bool:
        """Send one datagram; `notify(READY=1, STATUS="…")`. True if sent."""
        if self.address is None:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        with self._lock:
            try:
                if self._sock is None:
                    # Non-blocking: a receiver that stops reading (a full queue) must
                    # never stall the daemon's event loop; such a message is dropped.
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
                self._sock.sendto(payload, socket_address(self.address))
                return True
            except OSError as exc:
                if not self._warned:
                    log.warning("cannot notify systemd at %s: %s", self.address, exc)
                    self._warned = True
                return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text.replace("\n", " "))

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify(STOPPING=1, **({"STATUS": status} if status else {}))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: the notify and watchdog variables
    belong to this process alone (systemd would otherwise take the engine's
    messages, or none, for ours)."""
    out = dict(os.environ if env is None else env)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        out.pop(key, None)
    return out
