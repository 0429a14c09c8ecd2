"""What must not go wrong around the daemon: READY from another server on the
engine's port, a control socket in a directory others can write, a signal to
a pid reused since the snapshot, the API key on the engine's command line,
Ctrl-C that cannot stop it, and `zerod run` and `zerod top` looking for the
control socket in two places."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from test_daemon_lifecycle import FAKE_ENGINE, Daemon as DaemonProcess, firing, free_port  # same folder
from zerod.alerts import AlertBook
from zerod.checks.gpu_processes import GpuProcess
from zerod.control_api import ControlSocketError, bind_unix_socket, make_app
from zerod.daemon import Daemon
from zerod.daemon_config import DaemonConfig, default_socket
from zerod.supervisor import EngineSupervisor, engine_argv, engine_env
from test_daemon_metrics import _views

ROOT = Path(__file__).resolve().parent.parent


def start_fake_engine(tmp_path, port: int) -> subprocess.Popen:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    (tmp_path / "st.json").write_text("{}")
    p = subprocess.Popen([sys.executable, str(script), str(port), str(tmp_path / "st.json")])
    end = time.monotonic() + 10
    import socket

    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the stand-in engine did not listen")


# ------------------------------------------------------------------ READY identity
async def test_another_server_on_the_port_is_never_taken_for_the_engine(tmp_path, caplog):
    """A stand-in holds the port; our child (which would be the engine) never
    answers. No READY, the log names the other pid, and when the child gives
    up, EngineDown says why."""
    port = free_port()
    squatter = start_fake_engine(tmp_path, port)
    try:
        book = AlertBook()
        cfg = DaemonConfig.from_dict({"metrics_port": -1, "restart_backoff_initial_s": 30, "restart_backoff_max_s": 30})
        ready = []
        child = [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(1)"]  # cannot bind
        sup = EngineSupervisor(child, f"http://127.0.0.1:{port}", cfg, book, on_ready=lambda: ready.append(1))
        task = asyncio.create_task(sup.run())
        end = time.monotonic() + 6
        while not firing_in(book, "EngineDown") and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert not ready and sup.fig.state != "healthy"
        [down] = firing_in(book, "EngineDown")
        assert f"pid {squatter.pid}" in down.summary and "another process answers" in down.summary
        said = [r for r in caplog.records if r.name == "zerod.supervisor" and "another process answers" in r.message]
        assert len(said) == 1  # once, not every second
        await sup.stop(drain_timeout_s=1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        squatter.kill()
        squatter.wait()


def firing_in(book, name):
    return [a for a in book.firing() if a.alertname == name]


async def test_a_health_answer_without_pid_is_not_zerod_serve(tmp_path):
    sup = EngineSupervisor(["true"], "http://127.0.0.1:1", DaemonConfig(), AlertBook())
    assert "no pid in its answer" in sup._impostor(b"{}")
    other = EngineSupervisor(["true"], "http://127.0.0.1:1", DaemonConfig(), AlertBook(), pid_required=False)
    assert other._impostor(b"") is None  # another engine (engine_command) may not say its pid


def test_zerod_run_with_the_port_taken_never_says_ready(tmp_path):
    """End to end: the daemon's engine cannot bind (a stand-in holds the port):
    no READY=1, the log says who answers."""
    port = free_port()
    squatter = start_fake_engine(tmp_path, port)
    script = tmp_path / "fake_engine.py"
    d = DaemonProcess(tmp_path, f"""
[engine]
port = {port}
[daemon]
control_socket = "{tmp_path / 'control.sock'}"
metrics_port = -1
engine_command = ["{sys.executable}", "{script}", "{port}", "{tmp_path / 'st.json'}"]
""")
    try:
        d.wait_for(lambda: any("another process answers" in line for line in d.log), 15, "the impostor named")
        d.drain_notify()
        assert not any(m == "READY=1" for _, m in d.messages)
        d.wait_for(lambda: firing(d, "EngineDown"), 10, "EngineDown")
        assert f"pid {squatter.pid}" in firing(d, "EngineDown")[0]["summary"]
        assert d.stop() == 0
    finally:
        d.kill()
        squatter.kill()
        squatter.wait()


# ------------------------------------------------------------------ the control socket
def test_control_socket_directory_writable_by_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ControlSocketError, match="writable by others"):
        bind_unix_socket(str(shared / "control.sock"))
    own = tmp_path / "own"
    bind_unix_socket(str(own / "control.sock")).close()  # created 0700: fine


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_control_socket_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ControlSocketError, match="belongs to uid 65534"):
        bind_unix_socket(str(theirs / "control.sock"))


def test_zerod_run_refuses_a_shared_socket_directory_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(f'[daemon]\ncontrol_socket = "{shared / "c.sock"}"\nmetrics_port = -1\n')
    r = subprocess.run([sys.executable, "-m", "zerod", "run", "--demo", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if "cannot open the daemon's endpoints" in x]
    assert "writable by others (mode 1777)" in line


def test_a_taken_metrics_port_names_the_setting_and_the_holder(tmp_path):
    """A second daemon on a taken metrics port: one line naming [daemon] metrics_port and
    the process holding it, exit 78, no raw errno text alone."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    port = squatter.getsockname()[1]
    try:
        cfg = tmp_path / "zerod.toml"
        cfg.write_text(f'[daemon]\ncontrol_socket = "{tmp_path / "c.sock"}"\nmetrics_port = {port}\n')
        r = subprocess.run([sys.executable, "-m", "zerod", "run", "--demo", "--config", str(cfg)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    finally:
        squatter.close()
    assert r.returncode == 78 and "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if "cannot open the daemon's endpoints" in x]
    assert f"127.0.0.1:{port} ([daemon] metrics_port)" in line
    assert f"held by pid {os.getpid()}" in line, line


AS_USER = """
import os, sys
os.geteuid = lambda: 65534  # a non-root user
from click.testing import CliRunner
from zerod.cmd_run import run
from zerod.cmd_top import top
from zerod.daemon_config import DaemonConfig
print(DaemonConfig.from_dict({}).control_socket)
for cmd in (run, top):
    print(" ".join(CliRunner().invoke(cmd, ["--help"], terminal_width=400).output.split()))
"""


def test_run_and_top_agree_on_the_socket_without_xdg_runtime_dir():
    """A non-root user without $XDG_RUNTIME_DIR: `zerod run` binds where `zerod top` looks."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY")}
    r = subprocess.run([sys.executable, "-c", AS_USER], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    bound, run_help, top_help = r.stdout.splitlines()
    assert bound == default_socket(env={}, euid=65534) == "/tmp/zerod-65534/zerod/control.sock", r.stderr
    assert bound in run_help and bound in top_help


# ------------------------------------------------------------------ the signal action
async def test_signal_checks_the_process_is_still_the_one_seen():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        v = _views()
        v.allow_write_actions = True
        v.processes._scan = lambda **kw: [GpuProcess(pid=victim.pid, name="sleep", cmdline="sleep 60", gpus=[0],
                                                     gpu_memory_bytes=1 << 20, source="nvml")]
        v.processes.poll()
        seen = v.processes.start_times[victim.pid]
        assert seen is not None
        async with TestClient(TestServer(make_app(v))) as client:
            # the pid now belongs to another process (its start time differs): refused
            v.processes.start_times[victim.pid] = seen - 5
            r = await client.post(f"/v1/processes/{victim.pid}/signal", json={"signal": "TERM"})
            assert r.status == 409 and "start time differs" in (await r.json())["error"]
            assert victim.poll() is None
            # the very process seen: signalled
            v.processes.start_times[victim.pid] = seen
            r = await client.post(f"/v1/processes/{victim.pid}/signal", json={"signal": "TERM"})
            assert r.status == 200 and await r.json() == {"ok": True, "pid": victim.pid, "signal": "TERM"}
            assert victim.wait(5) == -signal.SIGTERM
            r = await client.post(f"/v1/processes/{victim.pid}/signal", json={"signal": "TERM"})
            assert r.status == 409  # gone
            r = await client.post("/v1/processes/1/signal", json=["TERM"])
            assert r.status == 409  # a body that is not an object is TERM; pid 1 is not foreign
    finally:
        victim.kill()
        victim.wait()


async def test_a_reused_pid_is_seen_as_its_new_process_at_the_next_scan():
    """The watcher recorded the start time of the pid's previous holder; once the pid is
    reused, the next scan records the new holder's, which can then be signalled."""
    holder = subprocess.Popen(["sleep", "60"])
    try:
        v = _views()
        v.allow_write_actions = True
        v.processes._scan = lambda **kw: [GpuProcess(pid=holder.pid, name="sleep", cmdline="sleep 60", gpus=[0],
                                                     gpu_memory_bytes=1 << 20, source="nvml")]
        v.processes.poll()
        real = v.processes.start_times[holder.pid]
        v.processes.start_times[holder.pid] = real - 5      # as recorded for the previous holder
        v.processes.first_seen[holder.pid] = 1.0
        v.processes._last_full = -1e9                         # the next full scan is due
        v.processes.poll()
        assert v.processes.start_times[holder.pid] == real
        assert v.processes.first_seen[holder.pid] != 1.0    # a new process: seen from now
        async with TestClient(TestServer(make_app(v))) as client:
            r = await client.post(f"/v1/processes/{holder.pid}/signal", json={"signal": "TERM"})
            assert r.status == 200, await r.text()
        assert holder.wait(5) == -signal.SIGTERM
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ the API key
def test_api_key_credential_goes_to_the_engine_environment_not_its_argv(tmp_path, caplog):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api_key").write_text("s3cret\n")
    config = {"engine": {"model": "demo", "api_key": "from-file"},
              "daemon": {"metrics_port": -1, "numa": "off"}, "doctor": {}, "alerts": {}}
    d = Daemon(config, env={"CREDENTIALS_DIRECTORY": str(creds)})
    views = d._build()
    assert views.engines[0].supervisor.env["VLLM_API_KEY"] == "s3cret"
    assert "ZEROD_API_KEY" not in views.engines[0].supervisor.env
    assert not any("s3cret" in a or "from-file" in a for a in views.engines[0].supervisor.command())
    assert "[engine] api_key is ignored" in caplog.text
    assert d.preflights[0].doctor.api_key_set  # net.bind_exposure knows the engine has a key
    # without the credential, the file setting still works (through the environment)
    assert engine_env({"api_key": "from-file"}) == {"ZEROD_API_KEY": "from-file"}
    assert "--api-key" not in engine_argv({"model": "demo", "api_key": "from-file"})


# ------------------------------------------------------------------ Ctrl-C
def test_first_ctrl_c_says_how_long_the_drain_may_take_second_stops_at_once(tmp_path):
    port = free_port()
    stubborn = tmp_path / "stubborn.py"
    # an engine that ignores SIGTERM: its drain would take the whole drain_timeout_s
    stubborn.write_text("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + FAKE_ENGINE)
    (tmp_path / "st.json").write_text("{}")
    d = DaemonProcess(tmp_path, f"""
[engine]
port = {port}
[daemon]
control_socket = "{tmp_path / 'control.sock'}"
metrics_port = -1
drain_timeout_s = 60
engine_command = ["{sys.executable}", "{stubborn}", "{port}", "{tmp_path / 'st.json'}"]
""")
    try:
        d.wait_message("READY=1", timeout=30)
        d.proc.send_signal(signal.SIGINT)
        d.wait_for(lambda: any("SIGINT: stopping" in line for line in d.log), 5, "the first SIGINT")
        line = next(x for x in d.log if "SIGINT: stopping" in x)
        assert "up to 60 s to drain" in line and "Ctrl-C again" in line and "SIGTERM" not in line
        time.sleep(0.5)
        assert d.proc.poll() is None  # still draining
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5
        assert any("second SIGINT: stopping now" in x for x in d.log)
    finally:
        d.kill()


# ------------------------------------------------------------------ the socket's directory chain
def test_a_directory_above_the_socket_writable_by_others_is_refused(tmp_path):
    """A 0777 directory anywhere above (another user could rename the daemon's own 0700
    directory and put a fake socket in its place) is refused, and named."""
    shared = tmp_path / "zerod-1000"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ControlSocketError, match=f"{shared} is writable by others.*not sticky"):
        bind_unix_socket(str(shared / "zerod" / "control.sock"))
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)   # as /tmp: others cannot move what this user owns in it
    bind_unix_socket(str(sticky / "mine" / "control.sock")).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_above_the_socket_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    (theirs / "zerod").mkdir(mode=0o700)
    with pytest.raises(ControlSocketError, match=f"{theirs} belongs to uid 65534"):
        bind_unix_socket(str(theirs / "zerod" / "control.sock"))


def test_the_dashboard_client_refuses_a_socket_a_stranger_could_have_swapped(tmp_path):
    from zerod.tui.client import ControlClient, DaemonUnreachable

    shared = tmp_path / "zerod-1000"
    (shared / "zerod").mkdir(parents=True)
    shared.chmod(0o777)
    path = shared / "zerod" / "control.sock"
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(path))
    fake.listen(1)
    try:
        with pytest.raises(DaemonUnreachable, match=f"{shared} is writable by others"):
            ControlClient(str(path), timeout=1).request("GET", "/v1/status")
    finally:
        fake.close()
    if os.geteuid() == 0:   # a socket that belongs to another user: not the daemon's
        own = tmp_path / "own"
        own.mkdir(mode=0o700)
        spoof = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        spoof.bind(str(own / "control.sock"))
        os.chown(own / "control.sock", 65534, 65534)
        try:
            with pytest.raises(DaemonUnreachable, match="belongs to uid 65534"):
                ControlClient(str(own / "control.sock"), timeout=1).request("GET", "/v1/status")
        finally:
            spoof.close()
