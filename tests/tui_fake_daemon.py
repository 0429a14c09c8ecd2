"""A little control-API server for the dashboard's tests: HTTP over a Unix socket,
serving the recorded JSON of tests/fixtures/control_api/ (docs/control-api.md).

It can be stopped and started again on the same path (the daemon going away and
coming back), made to answer garbage, and it records the POSTs it receives.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "control_api"
EIGHT_GPUS = FIXTURES / "eight_gpus"  # two TP4 engines, a rogue job (see _make.py)
NOW = 1764491200.0  # the clock the fixtures were written for (see _make.py)


def load_fixtures(folder: Path = FIXTURES) -> dict[str, Any]:
    """Every endpoint recorded in `folder` (doctor-h200.json is _make.py's input, not one)."""
    return {f.stem: json.loads(f.read_text()) for f in sorted(folder.glob("*.json")) if f.stem != "doctor-h200"}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class FakeDaemon:
    def __init__(self, socket_path: str | os.PathLike[str], fixtures: Path = FIXTURES) -> None:
        self.socket_path = str(socket_path)
        self.data = load_fixtures(fixtures)
        self.queries: list[str] = []  # the query strings of GET /v1/history
        self.garbage = False
        self.posts: list[tuple[str, Any]] = []
        self.gets = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- control
    def start(self) -> "FakeDaemon":
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                fake.gets += 1
                if fake.garbage:
                    self._send(200, b"<html>not the daemon</html>", "text/html")
                    return
                path, _, query = self.path.partition("?")
                m = re.fullmatch(r"/v1/(\w+)", path)
                if m and m.group(1) == "history":
                    fake.queries.append(query)
                with fake._lock:
                    doc = fake.data.get(m.group(1)) if m else None
                    body = json.dumps(doc).encode() if doc is not None else None
                if body is None:
                    self._send(404, b'{"error": "no such endpoint"}')
                else:
                    self._send(200, body)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    body = None
                fake.posts.append((self.path, body))
                m = re.fullmatch(r"/v1/processes/(\d+)/signal", self.path)
                if not m:
                    self._send(404, b'{"error": "no such endpoint"}')
                    return
                with fake._lock:
                    if not fake.data["status"].get("write_actions"):
                        self._send(403, b'{"error": "write actions are disabled ([daemon] allow_write_actions)"}')
                        return
                    pid = int(m.group(1))
                    procs = fake.data["processes"]["processes"]
                    if not any(p["pid"] == pid and p["role"] == "foreign" for p in procs):
                        self._send(409, b'{"error": "not a current foreign process"}')
                        return
                sig = (body or {}).get("signal")
                if sig not in ("TERM", "KILL"):
                    self._send(400, b'{"error": "signal must be TERM or KILL"}')
                    return
                self._send(200, json.dumps({"ok": True, "pid": pid, "signal": sig}).encode())

        self._server = _Server(self.socket_path, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def update(self, name: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self.data[name] = copy.deepcopy(doc)

    def set_write_actions(self, allowed: bool) -> None:
        with self._lock:
            self.data["status"]["write_actions"] = allowed
