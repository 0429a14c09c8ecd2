"""The alert state machine, its log lines, and the push to a real Alertmanager
(Debian's prometheus-alertmanager, started by the test on loopback)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from zerod.alerts import AlertBook, AlertmanagerPusher, logfmt
from zerod.registry import alert_names


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_fire_update_resolve_and_retention(caplog):
    clock = Clock()
    book = AlertBook(retention_s=3600, clock=clock)
    caplog.set_level(logging.INFO, logger="zerod.alerts")
    a = book.fire("ForeignGpuProcess", "2211", severity="critical", summary="dcgm-exporter (pid 2211) holds GPU 0",
                  labels={"gpu": 0, "process": "dcgm-exporter"}, fix="systemctl stop dcgm-exporter")
    assert a.id == "ForeignGpuProcess/2211" and a.state == "firing" and a.labels == {"gpu": "0", "process": "dcgm-exporter"}
    # the same condition again: no new alert, no new log line
    clock.t += 1
    book.fire("ForeignGpuProcess", "2211", severity="critical", summary="dcgm-exporter (pid 2211) holds GPU 0")
    assert len(book.firing()) == 1 and book.firing()[0].starts_at == 100.0
    assert len([r for r in caplog.records if "state=firing" in r.message]) == 1
    assert book.firing_counts()["ForeignGpuProcess"] == 1 and set(alert_names()) <= set(book.firing_counts())
    clock.t += 1
    r = book.resolve("ForeignGpuProcess", "2211")
    assert r.state == "resolved" and r.ends_at == 102.0
    assert book.resolve("ForeignGpuProcess", "2211") is None
    d = book.all()[0].to_dict()
    assert set(d) == {"id", "alertname", "severity", "state", "summary", "description", "labels", "fix",
                      "starts_at", "ends_at"}
    clock.t += 3601
    assert book.all() == []
    msgs = [r.message for r in caplog.records]
    assert any(m.startswith("alert=ForeignGpuProcess state=firing severity=critical id=ForeignGpuProcess/2211")
               and 'fix="systemctl stop dcgm-exporter"' in m for m in msgs)
    assert any("state=resolved" in m for m in msgs)
    assert [r.levelno for r in caplog.records][0] == logging.CRITICAL


def test_sync_resolves_what_is_no_longer_there_and_newest_first():
    clock = Clock()
    book = AlertBook(clock=clock)
    book.sync("GpuLost", {"0": dict(severity="critical", summary="GPU 0 lost"),
                          "1": dict(severity="critical", summary="GPU 1 lost")})
    clock.t += 1
    book.sync("GpuLost", {"1": dict(severity="critical", summary="GPU 1 lost")})
    assert [a.key for a in book.firing()] == ["1"]
    clock.t += 1
    book.fire("EngineDown", severity="critical", summary="x")
    assert [a.id for a in book.all()] == ["EngineDown", "GpuLost/0", "GpuLost/1"]


def test_logfmt_quotes_what_needs_quoting():
    assert logfmt({"a": "x", "b": "two words", "c": 'q"uote', "d": None, "e": ""}) == \
        'a=x b="two words" c="q\\"uote" e=""'


def test_pusher_payload_shape():
    clock = Clock(1_700_000_000.0)
    book = AlertBook(clock=clock)
    book.fire("XidError", "0:79", severity="critical", summary="GPU 0: Xid 79", labels={"gpu": 0, "xid": 79},
              fix="reboot")
    p = AlertmanagerPusher(book, "http://127.0.0.1:1", resend_interval_s=60, extra_labels={"cluster": "c1"},
                           instance="host1")
    [body] = p.payload(book.firing(), clock())
    assert body["labels"] == {"alertname": "XidError", "severity": "critical", "instance": "host1", "job": "zerod",
                              "cluster": "c1", "gpu": "0", "xid": "79", "zerod_id": "XidError/0:79"}
    assert body["annotations"] == {"summary": "GPU 0: Xid 79", "fix": "reboot"}
    assert body["startsAt"] == "2023-11-14T22:13:20Z" and body["endsAt"] == "2023-11-14T22:17:20Z"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def alertmanager(tmp_path):
    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if not exe:
        pytest.skip("prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager)")
    port = _free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text("route:\n  receiver: blackhole\n  group_wait: 0s\nreceivers:\n  - name: blackhole\n")
    proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            if urllib.request.urlopen(url + "/-/ready", timeout=1).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("alertmanager did not start: " + proc.stderr.read())
    yield url
    proc.terminate()
    proc.wait(10)


def _am_alerts(url: str) -> list[dict]:
    return json.load(urllib.request.urlopen(url + "/api/v2/alerts", timeout=2))


async def _until(fn, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = await asyncio.to_thread(fn)
        if r:
            return r
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out: {what}")


async def test_real_alertmanager_receives_resends_and_resolves(alertmanager):
    book = AlertBook()
    pusher = AlertmanagerPusher(book, alertmanager, resend_interval_s=0.5, timeout_s=2, instance="gpu-host-1")
    task = asyncio.create_task(pusher.run())
    try:
        book.fire("ForeignGpuProcess", "2211", severity="critical", summary="dcgm-exporter (pid 2211) holds GPU 0",
                  labels={"gpu": 0, "process": "dcgm-exporter", "pid": 2211}, fix="systemctl stop dcgm-exporter")

        def active():
            return [a for a in _am_alerts(alertmanager)
                    if a["labels"].get("alertname") == "ForeignGpuProcess" and a["status"]["state"] == "active"]

        [a] = await _until(active, 10, "alert active in Alertmanager")
        assert a["labels"]["instance"] == "gpu-host-1" and a["labels"]["pid"] == "2211"
        assert a["annotations"]["fix"] == "systemctl stop dcgm-exporter"
        first_push = pusher.pushes
        await asyncio.sleep(1.2)
        assert pusher.pushes >= first_push + 2, "firing alerts are re-sent"
        book.resolve("ForeignGpuProcess", "2211")
        await _until(lambda: not active(), 10, "alert resolved in Alertmanager")
        await _until(lambda: book.undelivered_resolved() == [], 5, "resolved state marked delivered")
        assert pusher.errors == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_unreachable_alertmanager_is_retried_not_fatal():
    book = AlertBook()
    pusher = AlertmanagerPusher(book, f"http://127.0.0.1:{_free_port()}", resend_interval_s=10, timeout_s=0.5)
    task = asyncio.create_task(pusher.run())
    try:
        book.fire("EngineDown", severity="critical", summary="x")
        await asyncio.sleep(0.5)
        assert pusher.errors >= 1 and pusher.last_error and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_daemon_pushes_engine_alerts_to_a_real_alertmanager(alertmanager, tmp_path):
    """End to end: `zerod run` with [alerts] alertmanager_url; the engine's
    allocator retries go up in its /metrics; Alertmanager holds AllocatorRetries."""
    import sys

    from test_daemon_lifecycle import FAKE_ENGINE, Daemon, free_port  # same folder

    port = free_port()
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    state = tmp_path / "state.json"
    state.write_text("{}")
    d = Daemon(tmp_path, f"""
[engine]
port = {port}
[daemon]
control_socket = "{tmp_path / 'control.sock'}"
metrics_port = -1
engine_command = ["{sys.executable}", "{script}", "{port}", "{state}"]
[alerts]
alertmanager_url = "{alertmanager}"
labels = {{ cluster = "test" }}
""")
    try:
        d.wait_message("READY=1", timeout=30)
        state.write_text(json.dumps({"retries": 5}))

        def in_am():
            return [a for a in _am_alerts(alertmanager) if a["labels"].get("alertname") == "AllocatorRetries"]

        [a] = d.wait_for(in_am, 10, "AllocatorRetries in Alertmanager")
        assert a["labels"]["cluster"] == "test" and a["labels"]["job"] == "zerod"
        assert a["status"]["state"] == "active" and "+5 retries" in a["annotations"]["summary"]
        assert d.stop() == 0
    finally:
        d.kill()
