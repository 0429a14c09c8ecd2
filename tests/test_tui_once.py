"""`zerod top --once [--json]` (tui/once.py) and standalone mode's reader of the host
(tui/local_source.py), without a terminal: against the fake daemon's recordings, and
against a stand-in NVML, /proc scan and doctor report when no daemon answers."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from rich.text import Text

from tui_fake_daemon import EIGHT_GPUS, NOW, FakeDaemon
from zerod.checks import last_report
from zerod.checks.gpu_processes import GpuProcess
from zerod.tui.client import ControlClient
from zerod.tui.local_source import LocalSource, NvmlUnavailable
from zerod.tui.once import print_once


@pytest.fixture
def daemon():
    d = tempfile.mkdtemp(prefix="zt")
    fake = FakeDaemon(os.path.join(d, "control.sock"), EIGHT_GPUS).start()
    yield fake
    fake.stop()
    shutil.rmtree(d, ignore_errors=True)


def once(path: str, local=None, *, as_json=False, width=120) -> tuple[int, str]:
    out = io.StringIO()
    code = print_once(ControlClient(path, timeout=1.0), local, as_json=as_json, now=NOW, out=out,
                      start_hint="sudo systemctl start zerod", width=width)
    return code, out.getvalue()


@pytest.mark.parametrize("width", [80, 120, 160])
def test_text_fits_the_width_and_says_what_the_dashboard_says(daemon, width):
    code, out = once(daemon.socket_path, width=width)
    assert code == 0
    lines = out.splitlines()
    assert max(Text(line).cell_len for line in lines) <= width
    assert "gpu-h200-07" in lines[0]
    assert [line.split()[1] for line in lines if re.match(r"GPU \d+ ", line)] == [str(i) for i in range(8)]
    procs = lines[lines.index(next(x for x in lines if x.startswith("GPU processes (12) · 2 foreign"))) + 1:]
    assert procs[0].split()[0] == "PID" and procs[1].split()[0] == "7001" and "⚠ foreign" in procs[1]
    assert procs[2].split()[0] == "2211" and "⚠ agent" in procs[2]
    assert "Alerts · 3 firing · 1 resolved" in out and "● critical ForeignGpuProcess" in out
    assert "✗ gpu.foreign_processes" in out
    if width >= 100:  # the full table: user, SM, CPU, RSS, elapsed
        assert procs[1].split()[:9] == ["7001", "5", "⚠", "foreign", "alice", "20.0", "GiB", "38%", "98%"]
        assert "1m36s" in procs[1]


def test_json_has_every_part(daemon):
    code, out = once(daemon.socket_path, as_json=True)
    doc = json.loads(out)
    assert code == 0 and doc["source"] == "daemon" and doc["daemon"]["reachable"] is True
    assert [g["index"] for g in doc["gpus"]] == list(range(8))
    assert [e["name"] for e in doc["engines"]] == ["a", "b"] and doc["engines"][1]["itl_p99_s"] == 0.0412
    assert len(doc["processes"]) == 12 and {p["pid"] for p in doc["processes"] if p["role"] == "foreign"} == {7001, 2211}
    assert len(doc["alerts"]) == 4 and doc["checks"]["summary"]["fail"] == 1


class FakeNvml:
    """The few pynvml calls standalone mode makes, for one H200 with the engine on it."""

    def nvmlSystemGetDriverVersion(self):
        return "580.159.03"

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=120 << 30, total=141 << 30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=93, memory=40)

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetPowerUsage(self, h):
        return 512_300

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4  # sw_power_cap

    def nvmlDeviceGetProcessUtilization(self, h, since):
        return [SimpleNamespace(pid=os.getpid(), smUtil=88, memUtil=30, timeStamp=since + 5)]


def scan(nvml=True, **_):
    me = os.getpid()
    return [GpuProcess(pid=me, name="python3", cmdline="python3 -m zerod serve --model m", user="zerod",
                       ppid=os.getppid(), gpus=[0], gpu_memory_bytes=100 << 30, source="nvml"),
            GpuProcess(pid=4242424, name="dcgm-exporter", cmdline="/usr/bin/dcgm-exporter", user="root",
                       gpus=[0], source="fd", devices=["/dev/nvidia0"])]


def report():
    return {"checks": [{"id": "gpu.foreign_processes", "status": "fail", "title": "Nothing but zerod holds the GPU",
                        "remediation": "stop dcgm-exporter", "message": "1 foreign process"}],
            "summary": {"pass": 3, "warn": 0, "fail": 1, "skip": 0, "error": 0, "exit_code": 2},
            "host": {"hostname": "h200-x"}, "taken_at": NOW - 120.0}


def test_standalone_reads_this_host_when_no_daemon_answers(tmp_path):
    local = LocalSource(nvml=FakeNvml, scan=scan, load_report=report, host="h200-x")
    missing = str(tmp_path / "none.sock")
    code, out = once(missing, local.snapshot, as_json=True)
    doc = json.loads(out)
    assert code == 0 and doc["source"] == "standalone" and doc["daemon"]["reachable"] is False
    assert "no such socket" in doc["daemon"]["error"]
    g = doc["gpus"][0]
    assert (g["name"], g["utilization_ratio"], g["power_watts"], g["clock_events_active"]) == \
        ("NVIDIA H200", 0.93, 512.3, ["sw_power_cap"])
    assert doc["nvml"]["driver_version"] == "580.159.03"
    engine, agent = doc["processes"]
    assert engine["role"] == "engine" and engine["sm_utilization_ratio"] == 0.88
    assert engine["rss_bytes"] > 0 and engine["started_at"] > 0 and engine["parent_name"]
    assert engine["cpu_percent"] is not None  # --once reads the host twice to measure it
    assert agent["role"] == "foreign" and agent["known_agent"] == "dcgm-exporter" and agent["rss_bytes"] is None
    assert doc["checks"]["summary"]["fail"] == 1 and doc["engines"] == [] and doc["alerts"] == []
    # the text names the missing daemon, how to start it, and still shows the report
    code, text = once(missing, local.snapshot)
    assert "the zerod daemon is not running" in text and "start it: sudo systemctl start zerod" in text
    assert "Host · doctor's last report" in text and "✗ gpu.foreign_processes" in text
    # every read grows the GPU history; the fd scan ran once (at most every 5 s)
    again = local.snapshot(NOW + 1)
    assert len(again.gpus["gpus"][0]["history"]["utilization_ratio"]) == 5
    assert local.scans == 1


def test_standalone_on_a_host_without_an_nvidia_gpu(tmp_path):
    def no_nvml():
        raise NvmlUnavailable("no NVIDIA driver found: libnvidia-ml.so.1 is not installed")

    local = LocalSource(nvml=no_nvml, scan=lambda nvml=True, **_: [], load_report=lambda: None, host="cpu-box")
    code, text = once(str(tmp_path / "none.sock"), local.snapshot)
    assert code == 0
    assert "no NVIDIA GPU to show: no NVIDIA driver found: libnvidia-ml.so.1 is not installed" in text
    assert "cpu-box" in text and "no doctor report yet: run `zerod doctor`" in text


def test_cli_once(daemon, tmp_path):
    from zerod.cli import cli

    result = CliRunner().invoke(cli, ["top", "--once", "--json", "--socket", daemon.socket_path])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["host"] == "gpu-h200-07"
    result = CliRunner().invoke(cli, ["top", "--json"])
    assert result.exit_code == 2 and "--json goes with --once" in result.output
    result = CliRunner().invoke(cli, ["top", "--once", "--no-standalone", "--socket", str(tmp_path / "none.sock")])
    assert result.exit_code == 1 and "cannot reach the daemon" in result.output


def test_last_report_keeps_the_newest(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROD_STATE_DIR", str(tmp_path / "state"))
    assert last_report.load() is None
    assert last_report.save({"checks": [], "summary": {"fail": 0}}, taken_at=100.0) is None
    assert last_report.load()["taken_at"] == 100.0
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"checks": [], "taken_at": 50.0}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    best = last_report.load((older, broken, tmp_path / "state" / last_report.NAME))
    assert best["taken_at"] == 100.0 and best["path"].endswith(last_report.NAME)
    monkeypatch.setenv("ZEROD_STATE_DIR", "/proc/no-such-dir")
    assert "cannot write" in last_report.save({"checks": []})


def test_cli_standalone_takes_the_allowed_processes_of_the_config(tmp_path, monkeypatch):
    from zerod.cli import cli
    from zerod.tui import local_source

    seen = {}

    class Recording(local_source.LocalSource):
        def __init__(self, **kw):
            seen.update(kw)
            super().__init__(nvml=lambda: (_ for _ in ()).throw(NvmlUnavailable("no GPU here")),
                             scan=lambda nvml=True, **_: [], load_report=lambda: None, **kw)

    monkeypatch.setattr(local_source, "LocalSource", Recording)
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(f'[daemon]\ncontrol_socket = "{tmp_path}/none.sock"\n'
                   '[doctor]\nallowed_gpu_processes = ["my-sidecar"]\n')
    result = CliRunner().invoke(cli, ["top", "--once", "--json", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert seen == {"allowed": ("my-sidecar",)}
    assert doc["source"] == "standalone" and doc["daemon"]["socket"] == f"{tmp_path}/none.sock"


def test_standalone_scans_processes_at_most_every_five_seconds():
    t = [0.0]
    local = LocalSource(nvml=FakeNvml, scan=scan, load_report=lambda: None, host="h", clock=lambda: t[0])
    for step in (0.0, 1.0, 4.9, 5.1, 6.0):
        t[0] = step
        local.snapshot(NOW + step)
    assert local.scans == 2  # at 0 and at 5.1


@pytest.mark.gpu
def test_standalone_reads_the_real_gpus(tmp_path):
    """On the H200: standalone mode reads every GPU through the shared layer, and this
    process, holding a CUDA context, is listed with its GPU memory and host figures."""
    import torch

    torch.ones(1 << 20, device="cuda")  # a CUDA context and some memory on GPU 0
    code, out = once(str(tmp_path / "none.sock"), LocalSource().snapshot, as_json=True)
    doc = json.loads(out)
    assert code == 0 and doc["source"] == "standalone" and doc["nvml"]["ok"]
    assert len(doc["gpus"]) == torch.cuda.device_count()
    assert all(g["name"] and g["memory_total_bytes"] > 0 and g["utilization_ratio"] is not None for g in doc["gpus"])
    me = [p for p in doc["processes"] if p["pid"] == os.getpid()]
    assert me and me[0]["gpu_memory_bytes"] and me[0]["rss_bytes"] and me[0]["cpu_percent"] is not None


def test_the_one_engine_of_a_daemon_shows_its_gpu():
    """A one-engine daemon's status names the engine's GPUs in its `engines` entry (the
    `engine` object is the contract's, without them): the engines line says GPU 0."""
    from zerod.tui.client import Snapshot
    from zerod.tui.widgets.engines import engine_line

    engine = {"state": "healthy", "up": True, "pid": 7, "kind": "zerod", "url": "http://127.0.0.1:8000",
              "model": "demo", "restarts": 0, "numa_node": None, "cpus": None}
    snap = Snapshot(status={"engine": engine, "engines": [{"name": "default", "gpus": [0], **engine}]},
                    checks={}, gpus={}, processes={}, alerts={}, engine={"running": 0})
    [doc] = snap.engine_docs()
    assert doc["name"] == "default" and doc["gpus"] == [0]
    assert " GPU 0 " in engine_line(doc, narrow=False).plain
