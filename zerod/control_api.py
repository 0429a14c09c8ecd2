"""The control API for `zerod top`: HTTP/1.1 + JSON over a Unix socket
(mode 0600), exactly as docs/control-api.md describes. Read-only unless
`[daemon] allow_write_actions = true`. Every answer comes from cached
snapshots: a request never waits on NVML or /proc.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # pragma: no cover
    from zerod.daemon import Daemon

log = logging.getLogger("zerod.control")


def make_app(d: "Daemon") -> web.Application:
    app = web.Application()

    async def status(_req):
        return web.json_response(d.status())

    async def checks(_req):
        return web.json_response(d.checks_doc())

    async def gpus(_req):
        return web.json_response(d.gpus_doc())

    async def processes(_req):
        return web.json_response(d.processes.snapshot() if d.processes else {"processes": []})

    async def alerts(_req):
        return web.json_response({"alerts": [a.to_dict() for a in d.book.all()]})

    async def engine(_req):
        return web.json_response(d.engine_doc())

    async def signal_process(req):
        if not d.cfg.allow_write_actions:
            return web.json_response(
                {"error": "write actions are disabled; set [daemon] allow_write_actions = true to enable them"},
                status=403)
        try:
            pid = int(req.match_info["pid"])
        except ValueError:
            return web.json_response({"error": "pid must be an integer"}, status=400)
        try:
            body = await req.json()
        except Exception:
            return web.json_response({"error": "body must be JSON: {\"signal\": \"TERM\"}"}, status=400)
        name = str((body or {}).get("signal", "TERM")).upper()
        if name not in ("TERM", "KILL"):
            return web.json_response({"error": "signal must be TERM or KILL"}, status=400)
        foreign = {r["pid"] for r in (d.processes.foreign() if d.processes else [])}
        if pid not in foreign:
            return web.json_response({"error": f"pid {pid} is not a current foreign GPU process"}, status=409)
        try:
            os.kill(pid, signal.SIGTERM if name == "TERM" else signal.SIGKILL)
        except ProcessLookupError:
            return web.json_response({"error": f"pid {pid} is gone"}, status=409)
        except PermissionError as exc:
            return web.json_response({"error": f"cannot signal pid {pid}: {exc}"}, status=403)
        log.warning("control API: sent SIG%s to foreign GPU process %d", name, pid)
        return web.json_response({"ok": True, "pid": pid, "signal": name})

    @web.middleware
    async def errors(req, handler):
        try:
            return await handler(req)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return web.json_response({"error": exc.reason}, status=exc.status)
            raise
        except Exception as exc:  # never a traceback to the client, never a crash
            log.exception("control API %s %s failed", req.method, req.path)
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    app.middlewares.append(errors)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/checks", checks)
    app.router.add_get("/v1/gpus", gpus)
    app.router.add_get("/v1/processes", processes)
    app.router.add_get("/v1/alerts", alerts)
    app.router.add_get("/v1/engine", engine)
    app.router.add_post("/v1/processes/{pid}/signal", signal_process)
    return app


def bind_unix_socket(path: str) -> socket.socket:
    """A listening socket at `path`, mode 0600 from the start (umask while
    binding, then chmod); a stale socket file left by a dead daemon is removed,
    a live one is refused."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale
        else:
            raise OSError(f"another daemon answers on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    sock.setblocking(False)
    return sock
