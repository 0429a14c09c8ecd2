"""Client of the daemon's control API (docs/control-api.md): HTTP/1.1 + JSON over a
Unix socket, with the standard library only.

Blocking by design: the dashboard calls it from thread workers, never from the UI
thread. Every failure surfaces as one of two exceptions with a message a person can
read: `DaemonUnreachable` (no socket, refused, timeout, not HTTP, not JSON) and
`ApiError` (the daemon answered with a 4xx/5xx and its `{"error": …}`).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from zerod.socket_dir import chain_problem, socket_owner_problem

DEFAULT_SOCKET = "/run/zerod/control.sock"
ENDPOINTS = ("status", "checks", "gpus", "processes", "alerts", "engine")
SIGNALS = ("TERM", "KILL")


class ControlError(Exception):
    """Base of the client's errors."""


class DaemonUnreachable(ControlError):
    """The daemon could not be reached or did not answer in the contract's shape."""


class UntrustedSocket(OSError):
    """The socket or a directory above it is not controlled by this user or root."""


class ApiError(ControlError):
    """The daemon answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over an AF_UNIX stream socket."""

    def __init__(self, socket_path: str, timeout: float = 2.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        # a socket another user could have swapped in is never talked to
        problem = os.path.lexists(self.socket_path) and (
            chain_problem(self.socket_path, own_dir=False) or socket_owner_problem(self.socket_path))
        if problem:
            raise UntrustedSocket(problem)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UntrustedSocket):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return "no such socket (is `zerod run` running?)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (the daemon is not listening)"
    if isinstance(exc, PermissionError):
        return "permission denied (the socket is mode 0600: run as the daemon's user or root)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out waiting for the daemon"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__}: {exc})".replace(": )", ")")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Snapshot:
    """One poll of every read endpoint. `taken_at` is the client's clock."""

    status: dict[str, Any]
    checks: dict[str, Any]
    gpus: dict[str, Any]
    processes: dict[str, Any]
    alerts: dict[str, Any]
    engine: dict[str, Any]
    taken_at: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)  # endpoint -> error (ApiError only)
    engines: dict[str, Any] = field(default_factory=dict)  # /v1/engines, read when there are several

    def engine_docs(self) -> list[dict[str, Any]]:
        """Each engine's status entry merged with its figures (/v1/engines), or the one engine."""
        listed = [e for e in (self.engines.get("engines") or []) if isinstance(e, dict)]
        if listed:
            return listed
        if self.status.get("engine") or self.engine:
            # the status's own entry for the engine carries its name and GPUs
            first = next((e for e in self.status.get("engines") or [] if isinstance(e, dict)), {})
            return [{**first, **(self.status.get("engine") or {}), **self.engine}]
        return []


class ControlClient:
    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request on a fresh connection; the JSON object of the answer."""
        conn = UnixHTTPConnection(self.socket_path, timeout=self.timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json"}
            if payload is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            status = resp.status
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonUnreachable(_describe(exc)) from exc
        finally:
            conn.close()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            snippet = raw[:60].decode("utf-8", "replace").strip()
            if status >= 400:
                raise ApiError(status, snippet or "(empty body)") from None
            raise DaemonUnreachable(f"{method} {path}: the answer is not JSON: {snippet!r}") from None
        if status >= 400:
            msg = data.get("error") if isinstance(data, dict) else None
            raise ApiError(status, str(msg or data))
        if not isinstance(data, dict):
            raise DaemonUnreachable(f"{method} {path}: expected a JSON object, got {type(data).__name__}")
        return data

    def get(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/{name}")

    def snapshot(self, now: float | None = None) -> Snapshot:
        """Every read endpoint. DaemonUnreachable if any of them cannot be read at all; an
        endpoint answering an error status leaves that part empty and is named in `errors`."""
        parts: dict[str, dict[str, Any]] = {}
        errors: dict[str, str] = {}
        for name in ENDPOINTS:
            try:
                parts[name] = self.get(name)
            except ApiError as exc:
                parts[name] = {}
                errors[name] = str(exc)
        engines: dict[str, Any] = {}
        if len(parts["status"].get("engines") or []) > 1:
            try:
                engines = self.get("engines")
            except ApiError as exc:
                errors["engines"] = str(exc)
        return Snapshot(**parts, taken_at=time.time() if now is None else now, errors=errors, engines=engines)

    def history(self, seconds: float, points: int, engine: str | None = None) -> dict[str, Any]:
        """GET /v1/history: the daemon's samples of the last `seconds`, in `points` buckets."""
        query = f"seconds={seconds:g}&points={int(points)}"
        if engine is not None:
            query += "&engine=" + urllib.parse.quote(engine, safe="")
        return self.request("GET", f"/v1/history?{query}")

    def signal(self, pid: int, sig: str = "TERM") -> dict[str, Any]:
        if sig not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}")
        return self.request("POST", f"/v1/processes/{int(pid)}/signal", {"signal": sig})
