"""`zerod top` against the real daemon (`zerod run --demo`, CPU engine with the demo
model): the contract of docs/control-api.md as both sides implement it, end to end.
Then the daemon stops and the dashboard says so."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from zerod.tui.app import ZerodTop
from zerod.tui.client import ControlClient, ControlError
from zerod.tui.widgets.alerts import AlertTable
from zerod.tui.widgets.processes import ProcessTable

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def real_daemon():
    pytest.importorskip("zerod.daemon")
    d = tempfile.mkdtemp(prefix="ztr")
    sock = os.path.join(d, "control.sock")
    cfg = os.path.join(d, "zerod.toml")
    with open(cfg, "w") as f:
        f.write(f"[engine]\nport = {_free_port()}\n\n[daemon]\nallow_write_actions = true\n")
    log = open(os.path.join(d, "daemon.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerod", "run", "--demo", "--config", cfg,
                             "--metrics-port", "0", "--control-socket", sock],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = ControlClient(sock, timeout=2.0)
        end = time.monotonic() + 60
        while True:
            try:
                if client.get("status")["engine"]["state"] == "healthy":
                    break
            except (ControlError, KeyError, TypeError):
                pass
            if proc.poll() is not None or time.monotonic() > end:
                log.seek(0)
                pytest.fail(f"the daemon did not become healthy:\n{log.read()[-3000:]}")
            time.sleep(0.2)
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


async def until(pilot, cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await pilot.pause(0.05)
    await pilot.pause()


async def test_dashboard_on_the_real_daemon(real_daemon):
    proc, sock = real_daemon
    app = ZerodTop(sock, interval=0.3, timeout=2.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        snap = app.snapshot
        assert app.error is None and snap.errors == {}
        assert snap.status["engine"]["state"] == "healthy"
        assert snap.status["write_actions"] is True and app.check_action("signal", ()) is True
        assert isinstance(snap.engine.get("history"), dict)
        assert app.query_one(ProcessTable).row_count == len(snap.processes["processes"])
        assert app.query_one(AlertTable).row_count == len(snap.alerts["alerts"])
        await pilot.press("question_mark", "escape", "p", "p")
        proc.send_signal(signal.SIGTERM)  # the daemon goes away
        proc.wait(timeout=30)
        await until(pilot, lambda: app.error is not None)
        assert app.is_running and app.query_one("#banner").display
