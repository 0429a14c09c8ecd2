"""Which engines serve on which GPUs, so `zerod diag` never loads a GPU an engine
is serving on by accident: the daemon's control API says (/v1/engines: each
engine's name, GPUs, state and pid). No daemon answering: no engine known."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

SERVING_STATES = ("starting", "healthy", "unhealthy", "restarting")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def engines_from_daemon(socket_path: str, timeout: float = 2.0) -> tuple[list[dict[str, Any]], str | None]:
    """(engines, None), or ([], why not) when no daemon answers on the socket."""
    conn = _UnixConnection(socket_path, timeout)
    try:
        conn.request("GET", "/v1/engines")
        resp = conn.getresponse()
        doc = json.loads(resp.read() or b"{}")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return [], f"no daemon answers on {socket_path} ({type(exc).__name__}: {exc})"
    finally:
        conn.close()
    engines = doc.get("engines") if isinstance(doc, dict) else None
    return (engines if isinstance(engines, list) else []), None


def busy(engines: list[dict[str, Any]], gpus: list[int]) -> list[str]:
    """One line per engine serving on any of `gpus`, naming it (empty: all free)."""
    out = []
    for e in engines:
        on = sorted(set(e.get("gpus") or []) & set(gpus))
        if on and e.get("state") in SERVING_STATES:
            pid = f", pid {e['pid']}" if e.get("pid") else ""
            out.append(f"engine {e.get('name', '?')} ({e.get('model') or '?'}, {e.get('state')}{pid}) "
                       f"serves on GPU {', '.join(map(str, on))}")
    return out
