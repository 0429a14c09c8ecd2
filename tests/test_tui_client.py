"""The control-API client (zerod.tui.client) against a little daemon on a Unix socket."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest

from tui_fake_daemon import FakeDaemon
from zerod.tui.client import ApiError, ControlClient, DaemonUnreachable


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="zt")  # short: AF_UNIX paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(sock_dir):
    fake = FakeDaemon(os.path.join(sock_dir, "control.sock")).start()
    yield fake
    fake.stop()


def test_snapshot_reads_every_endpoint(daemon):
    snap = ControlClient(daemon.socket_path).snapshot(now=123.0)
    assert snap.status["host"] == "gpu-h200-07"
    assert snap.gpus["gpus"][0]["name"] == "NVIDIA H200"
    assert [p["pid"] for p in snap.processes["processes"]][:2] == [2211, 48211]
    assert snap.alerts["alerts"][0]["alertname"] == "LatencyRegression"
    assert snap.engine["kv_pages_total"] == 16384
    assert snap.checks["checks"] and snap.taken_at == 123.0 and snap.errors == {}


def test_missing_socket(sock_dir):
    with pytest.raises(DaemonUnreachable, match="no such socket"):
        ControlClient(os.path.join(sock_dir, "nope.sock")).get("status")


def test_refused(sock_dir):
    path = os.path.join(sock_dir, "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening: what a crashed daemon leaves behind
    try:
        with pytest.raises(DaemonUnreachable, match="refused"):
            ControlClient(path).get("status")
    finally:
        s.close()


def test_garbage_answer(daemon):
    daemon.garbage = True
    with pytest.raises(DaemonUnreachable, match="not JSON"):
        ControlClient(daemon.socket_path).get("status")


def test_not_http(sock_dir):
    path = os.path.join(sock_dir, "junk.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    import threading

    def serve():
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(DaemonUnreachable, match="not an HTTP answer"):
            ControlClient(path, timeout=2).get("status")
    finally:
        srv.close()


def test_timeout(sock_dir):
    path = os.path.join(sock_dir, "slow.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)  # accepts into the backlog, never answers
    try:
        with pytest.raises(DaemonUnreachable, match="timed out"):
            ControlClient(path, timeout=0.2).get("status")
    finally:
        srv.close()


def test_signal_forbidden_then_allowed(daemon):
    client = ControlClient(daemon.socket_path)
    with pytest.raises(ApiError) as err:
        client.signal(2211, "TERM")
    assert err.value.status == 403 and "disabled" in err.value.message
    daemon.set_write_actions(True)
    assert client.signal(2211, "KILL") == {"ok": True, "pid": 2211, "signal": "KILL"}
    with pytest.raises(ApiError) as err:
        client.signal(48211, "TERM")  # the engine is not foreign
    assert err.value.status == 409
    assert daemon.posts[-1] == ("/v1/processes/48211/signal", {"signal": "TERM"})
    with pytest.raises(ValueError):
        client.signal(2211, "HUP")


def test_endpoint_error_is_partial(daemon):
    daemon.data.pop("checks")  # the fake answers 404 for it
    snap = ControlClient(daemon.socket_path).snapshot()
    assert snap.checks == {} and "HTTP 404" in snap.errors["checks"]
    assert snap.status["host"] == "gpu-h200-07"
