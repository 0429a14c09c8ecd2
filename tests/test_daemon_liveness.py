"""The daemon's liveness rule (issue 36, item 2): a slow engine is not a dead one. A stand-in
engine whose /health handler spins (a busy event loop: the process works, the probe times
out) keeps running through a stall shorter than the rule allows; a stopped process is
restarted after the configured failures, each logged with the process's evidence first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_daemon_lifecycle import Daemon, firing, free_port
from zerod import liveness

STALLING_ENGINE = r'''
import http.server, json, os, sys, time
port, state = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        try:
            st = json.load(open(state))
        except Exception:
            st = {}
        while time.time() < st.get("stall_until", 0):   # busy: working, not answering
            pass
        body = json.dumps({"pid": os.getpid()}).encode() if self.path == "/health" else b""
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def stalling(tmp_path):
    port = free_port()
    script = tmp_path / "stalling_engine.py"
    script.write_text(STALLING_ENGINE)
    state = tmp_path / "engine_state.json"
    state.write_text("{}")
    return port, script, state


def _config(tmp, port, script, state, extra: str = "") -> str:
    return f"""
[engine]
port = {port}
[daemon]
control_socket = "{tmp / 'control.sock'}"
metrics_port = 0
engine_command = ["{sys.executable}", "{script}", "{port}", "{state}"]
restart_backoff_initial_s = 0.5
{extra}
"""


def _engine(d: Daemon) -> dict:
    return d.api()[1]["engine"]


def test_a_stall_shorter_than_the_rule_is_not_a_kill(tmp_path, stalling):
    """Defaults: a /health stall of 6 s (twice the probe timeout) costs no restart."""
    port, script, state = stalling
    d = Daemon(tmp_path, _config(tmp_path, port, script, state), abstract=True)
    try:
        d.wait_message("READY=1", timeout=30)
        pid = _engine(d)["pid"]
        state.write_text(json.dumps({"stall_until": time.time() + 6}))
        d.wait_for(lambda: any("/health failed 1/3" in line for line in d.log), 10,
                   "the first failed probe logged")
        d.wait_for(lambda: any("answers /health again" in line for line in d.log), 20,
                   "the engine answering again")
        eng = d.wait_for(lambda: (lambda e: e if e["state"] == "healthy" else None)(_engine(d)),
                         5, "healthy again")
        assert eng["pid"] == pid and eng["restarts"] == 0
        assert not firing(d, "EngineDown")
        assert d.stop() == 0
    finally:
        d.kill()


def test_a_working_engine_is_slow_not_dead_until_the_slow_limit(tmp_path, stalling):
    port, script, state = stalling
    d = Daemon(tmp_path, _config(tmp_path, port, script, state, "health_failure_threshold = 2\n"
                                 "health_failure_period_s = 0.5\nhealth_slow_limit_s = 9\n"
                                 "drain_timeout_s = 2\n"),
               abstract=True)
    try:
        d.wait_message("READY=1", timeout=30)
        pid = _engine(d)["pid"]
        t0 = time.monotonic()
        state.write_text(json.dumps({"stall_until": time.time() + 120}))
        d.wait_for(lambda: any("the engine is working" in line for line in d.log), 15,
                   "the slow verdict logged")
        assert _engine(d)["pid"] == pid, "killed while judged slow"
        alert = d.wait_for(lambda: firing(d, "EngineDown"), 20, "EngineDown past the slow limit")
        assert time.monotonic() - t0 >= 9
        assert "slow, not dead" in alert[0]["summary"]
        state.write_text("{}")
        d.wait_for(lambda: (lambda e: e if e["state"] == "healthy" and e["pid"] != pid else None)(
            _engine(d)), 20, "restarted engine")
        assert d.stop() == 0
    finally:
        d.kill()


def test_a_stopped_engine_is_dead_after_the_failures_with_evidence_first(tmp_path, stalling):
    port, script, state = stalling
    d = Daemon(tmp_path, _config(tmp_path, port, script, state, "health_failure_threshold = 2\n"
                                 "health_failure_period_s = 0.5\n"), abstract=True)
    try:
        d.wait_message("READY=1", timeout=30)
        pid = _engine(d)["pid"]
        os.kill(pid, signal.SIGSTOP)
        alert = d.wait_for(lambda: firing(d, "EngineDown"), 15, "EngineDown after SIGSTOP")
        assert "not progressing" in alert[0]["summary"] and "stopped" in alert[0]["summary"]
        first = next(i for i, line in enumerate(d.log) if "/health failed 1/2" in line)
        verdict = next(i for i, line in enumerate(d.log) if "restarting it" in line)
        assert first < verdict
        d.wait_for(lambda: (lambda e: e if e["state"] == "healthy" and e["pid"] != pid else None)(
            _engine(d)), 20, "restarted engine")
        assert d.stop() == 0
    finally:
        d.kill()


def test_evidence_tells_a_busy_process_from_a_stopped_one():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        os.kill(idle.pid, signal.SIGSTOP)
        stalls = {"busy": liveness.Stall(busy.pid), "idle": liveness.Stall(idle.pid)}
        for s in stalls.values():
            s.failed()
        time.sleep(0.5)
        for s in stalls.values():
            s.failed()
        assert stalls["busy"].slow and "slow, not dead" in stalls["busy"].evidence()
        assert not stalls["idle"].slow
        assert "stopped" in stalls["idle"].evidence()
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_an_engine_in_its_own_process_is_judged_by_its_threads_there():
    """`zerod serve --engine-process`: /health names the engine process's threads apart
    (engine_threads); the evidence counts their CPU though they are a child's."""
    code = ("import subprocess, sys, threading, time\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import threading\\nt = threading.Thread(target=lambda: [0 for _ in iter(int, 1)], name=\"zerod-step\")\\n"
            "t.start(); print(t.native_id, flush=True); t.join()'], stdout=subprocess.PIPE, text=True)\n"
            "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
            "time.sleep(60)\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid, tid = (int(x) for x in server.stdout.readline().split())
        names = liveness.thread_names({"threads": {"zerod-http": server.pid},
                                       "engine_threads": {"zerod-step": tid}, "engine_pid": child_pid})
        assert names == {server.pid: "zerod-http", tid: "zerod-step"}
        stall = liveness.Stall(server.pid, names)
        stall.failed()
        time.sleep(0.5)
        stall.failed()
        assert stall.slow and "zerod-step +" in stall.evidence()
    finally:
        for p in psutil.Process(server.pid).children(recursive=True):
            p.kill()
        server.kill()
        server.wait()
