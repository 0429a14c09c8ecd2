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

from aiohttp import web

from zerod.history import HistoryError, NoSuchSeries, query_args
from zerod.socket_dir import chain_problem
from zerod.views import NoSuchEngine, Views
from zerod.watchers.gpu_processes import process_start_time

log = logging.getLogger("zerod.control")


class ControlSocketError(OSError):
    """The control socket cannot be bound safely here; the message says why."""


def make_app(views: Views) -> web.Application:
    app = web.Application()

    def doc(build):
        async def handler(_req):
            return web.json_response(build())
        return handler

    def engine_doc(build):
        """A document of one engine: ?engine=NAME, or the first engine."""
        async def handler(req):
            try:
                return web.json_response(build(req.query.get("engine")))
            except NoSuchEngine as exc:
                return web.json_response({"error": str(exc)}, status=404)
        return handler

    async def signal_process(req):
        if not views.allow_write_actions:
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
        name = str((body if isinstance(body, dict) else {}).get("signal", "TERM")).upper()
        if name not in ("TERM", "KILL"):
            return web.json_response({"error": "signal must be TERM or KILL"}, status=400)
        foreign, seen_start = views.foreign_start_time(pid)
        if not foreign:
            return web.json_response({"error": f"pid {pid} is not a current foreign GPU process"}, status=409)
        # the snapshot may be a second old: the pid must still be the process it saw
        now_start = process_start_time(pid)
        if now_start is None:
            return web.json_response({"error": f"pid {pid} is gone"}, status=409)
        if seen_start is None or abs(now_start - seen_start) > 0.01:
            return web.json_response(
                {"error": f"pid {pid} is not the process seen holding the GPU (its start time differs): "
                          f"not signalled; look again at /v1/processes"}, status=409)
        try:
            os.kill(pid, signal.SIGTERM if name == "TERM" else signal.SIGKILL)
        except ProcessLookupError:
            return web.json_response({"error": f"pid {pid} is gone"}, status=409)
        except PermissionError as exc:
            return web.json_response({"error": f"cannot signal pid {pid}: {exc}"}, status=403)
        log.warning("control API: sent SIG%s to foreign GPU process %d", name, pid)
        return web.json_response({"ok": True, "pid": pid, "signal": name})

    async def diag_doc(_req):
        if views.diag is None:
            return web.json_response({"error": "this daemon runs no diag"}, status=404)
        return web.json_response(views.diag.doc())

    async def diag_run(req):
        from zerod.diag.service import DiagRefused

        if views.diag is None:
            return web.json_response({"error": "this daemon runs no diag"}, status=404)
        if not views.allow_write_actions:
            return web.json_response(
                {"error": "write actions are disabled; set [daemon] allow_write_actions = true to enable them"},
                status=403)
        try:
            body = await req.json() if req.can_read_body else {}
        except Exception:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": "body must be a JSON object: {\"level\": \"quick\", "
                                               "\"gpus\": [0], \"force\": false}"}, status=400)
        unknown = sorted(set(body) - {"level", "gpus", "force"})
        if unknown:
            return web.json_response({"error": f"unknown field(s) {', '.join(unknown)}; known: level, gpus, force"},
                                     status=400)
        gpus, force = body.get("gpus"), body.get("force", False)
        if gpus is not None and (not isinstance(gpus, list) or not all(
                isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus) or not gpus):
            return web.json_response({"error": "gpus must be a non-empty list of GPU indexes"}, status=400)
        if not isinstance(force, bool):
            return web.json_response({"error": "force must be true or false"}, status=400)
        try:
            running = views.diag.start(body.get("level", "quick"), sorted(set(gpus)) if gpus else None, force)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except DiagRefused as exc:
            return web.json_response({"error": str(exc)}, status=409)
        log.warning("control API: zerod diag --level %s started (gpus %s%s)", running["level"],
                    running["gpus"] if running["gpus"] is not None else "all", ", forced" if force else "")
        return web.json_response({"ok": True, "running": running}, status=202)

    async def history(req):
        if views.history is None:
            return web.json_response({"error": "this daemon keeps no history"}, status=404)
        try:
            return web.json_response(views.history.query(**query_args(req.query)))
        except HistoryError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except NoSuchSeries as exc:
            return web.json_response({"error": str(exc)}, status=404)

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
    app.router.add_get("/v1/status", doc(views.status))
    app.router.add_get("/v1/checks", engine_doc(views.checks))
    app.router.add_get("/v1/gpus", doc(views.gpus))
    app.router.add_get("/v1/processes", doc(views.processes_doc))
    app.router.add_get("/v1/alerts", doc(views.alerts))
    app.router.add_get("/v1/engine", engine_doc(views.engine))
    app.router.add_get("/v1/engines", doc(views.engines_doc))
    app.router.add_get("/v1/history", history)
    app.router.add_post("/v1/processes/{pid}/signal", signal_process)
    app.router.add_get("/v1/diag", diag_doc)
    app.router.add_post("/v1/diag", diag_run)
    return app


def check_socket_directory(socket_path: str) -> None:
    """Refuse a socket another user could swap: its whole directory chain is checked
    (zerod.socket_dir), the directory that is wrong named."""
    problem = chain_problem(socket_path)
    if problem:
        raise ControlSocketError(problem)


def bind_unix_socket(path: str) -> socket.socket:
    """A listening socket at `path`, mode 0600 from the start (umask while
    binding, then chmod); a stale socket file left by a dead daemon is removed,
    a live one is refused."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    check_socket_directory(path)
    if os.path.exists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale
        else:
            raise ControlSocketError(f"another daemon answers on {path}")
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
