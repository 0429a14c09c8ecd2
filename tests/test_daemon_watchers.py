"""The watchers' logic on injected data at their boundaries: a small fake
pynvml module (what NVML would return), recorded GpuProcess rows and a fake
/proc tree (what the checks room's scan reads), Prometheus text (what the
engine serves). The watchers' own output (alerts, snapshots) is never faked."""

from __future__ import annotations

import os
import types

import pytest

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.watchers.engine_metrics import EngineMetricsWatcher, Histogram, parse_metrics
from zerod.watchers.gpu_processes import GpuProcessWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.nvml_session import NvmlSession
from zerod.checks.clock_events import reasons_from_mask
from zerod.watchers.nvml_stats import NvmlStatsWatcher
from zerod.watchers.xid_events import XidWatcher


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def fake_nvml(n=1, **over):
    """A pynvml stand-in: plain data per GPU, mutable by the test."""
    gpus = [dict(util=50, used=10 << 30, total=141 << 30, temp=60, power_mw=400_000, limit_mw=700_000,
                 sm=1980, mem=3201, reasons=0, replays=0, ecc=0, remap=(0, 0, 0, 0), lost=False,
                 bus=f"00000000:{0x18 + i:02X}:00.0") for i in range(n)]
    for g in gpus:
        g.update(over)
    N = types.SimpleNamespace(gpus=gpus, init_error=None, events=[])
    N.NVMLError = NVMLError

    def h(i):
        return gpus[i]

    def guard(g):
        if g["lost"]:
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        return g

    def init():
        if N.init_error is not None:
            raise NVMLError(N.init_error)

    N.nvmlInit = init
    N.nvmlShutdown = lambda: None
    N.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    N.nvmlDeviceGetCount = lambda: len(gpus)
    N.nvmlDeviceGetHandleByIndex = h
    N.nvmlDeviceGetIndex = lambda g: gpus.index(g)
    N.nvmlDeviceGetUUID = lambda g: f"GPU-{gpus.index(g):04d}"
    N.nvmlDeviceGetName = lambda g: "NVIDIA H200"
    N.nvmlDeviceGetPciInfo = lambda g: types.SimpleNamespace(busId=g["bus"].encode())
    N.nvmlDeviceGetMemoryInfo = lambda g: types.SimpleNamespace(used=guard(g)["used"], total=g["total"])
    N.nvmlDeviceGetUtilizationRates = lambda g: types.SimpleNamespace(gpu=guard(g)["util"], memory=0)
    N.nvmlDeviceGetTemperature = lambda g, sensor: guard(g)["temp"]
    N.nvmlDeviceGetPowerUsage = lambda g: guard(g)["power_mw"]
    N.nvmlDeviceGetEnforcedPowerLimit = lambda g: g["limit_mw"]
    N.nvmlDeviceGetClockInfo = lambda g, which: g["sm"] if which == 1 else g["mem"]
    N.nvmlDeviceGetCurrentClocksEventReasons = lambda g: guard(g)["reasons"]
    N.nvmlDeviceGetPcieReplayCounter = lambda g: g["replays"]
    N.nvmlDeviceGetTotalEccErrors = lambda g, kind, counter: g["ecc"]

    def remap(g):
        if g["remap"] is None:
            raise NVMLError(3)  # not supported
        return g["remap"]

    N.nvmlDeviceGetRemappedRows = remap
    # XID events: the test appends (gpu, xid) to N.events
    N.nvmlEventSetCreate = lambda: object()
    N.nvmlDeviceRegisterEvents = lambda g, kind, es: None
    N.nvmlEventSetFree = lambda es: None

    def wait(es, ms):
        if N.events:
            gpu, xid = N.events.pop(0)
            return types.SimpleNamespace(device=gpus[gpu], eventType=8, eventData=xid)
        import time

        time.sleep(min(ms, 20) / 1000)
        raise NVMLError(10)  # NVML_ERROR_TIMEOUT

    N.nvmlEventSetWait_v2 = wait
    return N


def cfg(**kw):
    # full_scan_interval_s = 0: every poll scans in full (the injected rows change
    # while /proc does not); the cheap path between scans has its own test
    return DaemonConfig.from_dict({"metrics_port": 0, "full_scan_interval_s": 0, **kw})


def firing(book, name):
    return [a for a in book.firing() if a.alertname == name]


# --------------------------------------------------------------------- NVML stats
def test_nvml_stats_snapshot_follows_the_contract():
    N = fake_nvml(2)
    book, clock = AlertBook(), Clock()
    w = NvmlStatsWatcher(NvmlSession(N), book, cfg(), clock=clock)
    w.poll()
    doc = w.snapshot()
    assert doc["nvml"] == {"ok": True, "error": None, "driver_version": "580.159.04"}
    g = doc["gpus"][0]
    for key in ("index", "uuid", "name", "utilization_ratio", "memory_used_bytes", "memory_total_bytes",
                "temperature_celsius", "power_watts", "power_limit_watts", "sm_clock_mhz", "mem_clock_mhz",
                "clock_events_active", "pcie_replays_total", "ecc_volatile_uncorrected", "history"):
        # xid_events_total is the XID watcher's: zerod.views adds it (test_daemon_metrics)
        assert key in g
    assert g["utilization_ratio"] == 0.5 and g["power_watts"] == 400.0 and g["uuid"] == "GPU-0000"
    assert g["history"]["temperature_celsius"] == [60]
    assert not book.firing()


def test_throttle_hot_ecc_and_pcie_replays_alert_and_resolve():
    N = fake_nvml(1)
    book, clock = AlertBook(clock=Clock()), Clock()
    w = NvmlStatsWatcher(NvmlSession(N), book, cfg(throttle_for_s=5, counter_alert_hold_s=60), clock=clock)
    w.poll()
    g = N.gpus[0]
    # sw_power_cap alone is normal under load: no alert
    g["reasons"] = 0x4
    w.poll()
    assert w.gpus[0].clock_events_active == ["sw_power_cap"] and not firing(book, "GpuThrottled")
    # HW thermal slowdown must hold throttle_for_s
    g["reasons"] = 0x4 | 0x40
    w.poll()
    assert not firing(book, "GpuThrottled")
    clock.t += 6
    w.poll()
    [a] = firing(book, "GpuThrottled")
    assert "hw_thermal_slowdown" in a.summary and "airflow" in a.fix
    g["reasons"] = 0
    w.poll()
    assert not firing(book, "GpuThrottled")
    # temperature with hysteresis
    g["temp"] = 90
    w.poll()
    assert firing(book, "GpuHot")
    g["temp"] = 84
    w.poll()
    assert firing(book, "GpuHot")
    g["temp"] = 70
    w.poll()
    assert not firing(book, "GpuHot")
    # ECC: volatile uncorrected errors, a pending remap
    g["ecc"], g["remap"] = 2, (0, 1, 1, 0)
    w.poll()
    [a] = firing(book, "EccErrors")
    assert "2 volatile uncorrected" in a.summary and "pending" in a.summary
    g["ecc"], g["remap"] = 0, (0, 1, 0, 0)
    w.poll()
    assert not firing(book, "EccErrors")
    # PCIe replays: any increase, held counter_alert_hold_s
    g["replays"] = 3
    w.poll()
    [a] = firing(book, "PcieReplays")
    assert "3 PCIe replay" in a.summary
    clock.t += 30
    w.poll()
    assert firing(book, "PcieReplays")
    clock.t += 31
    w.poll()
    assert not firing(book, "PcieReplays")


def test_gpu_lost_and_nvml_missing_are_alerts_not_crashes():
    N = fake_nvml(2)
    book = AlertBook()
    s = NvmlSession(N, retry_s=0)
    w = NvmlStatsWatcher(s, book, cfg())
    w.poll()
    N.gpus[1]["lost"] = True
    w.poll()  # must not raise
    [a] = firing(book, "GpuLost")
    assert a.key == "1" and a.severity == "critical" and "lost" in a.summary
    assert 0 in w.gpus and 1 not in w.gpus
    # NVML that cannot start (no driver): NvmlUnavailable, retried later
    M = fake_nvml(1)
    M.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    book2 = AlertBook()
    w2 = NvmlStatsWatcher(NvmlSession(M, retry_s=0), book2, cfg())
    w2.poll()
    [a] = firing(book2, "NvmlUnavailable")
    assert "kernel module is not loaded" in a.description and a.severity == "critical"
    M.init_error = None
    w2.poll()
    assert not firing(book2, "NvmlUnavailable") and w2.gpus


def test_nvml_bindings_missing_is_an_alert(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    book = AlertBook()
    w = NvmlStatsWatcher(NvmlSession(None, retry_s=0), book, cfg(), demo=True)
    w.poll()
    [a] = firing(book, "NvmlUnavailable")
    assert "nvidia-ml-py" in a.description and a.severity == "info"


def test_clock_reason_names_match_the_control_api():
    assert reasons_from_mask(0x1 | 0x8 | 0x80 | 0x100) == [
        "gpu_idle", "hw_slowdown", "hw_power_brake_slowdown", "display_clock_setting"]


# --------------------------------------------------------------------- XID events
def test_xid_event_thread_raises_alert_with_meaning_and_action():
    N = fake_nvml(2)
    book, clock = AlertBook(), Clock()
    s = NvmlSession(N)
    assert s.ensure()
    w = XidWatcher(s, book, cfg(counter_alert_hold_s=100), wait_ms=20, clock=clock)
    try:
        w.check()  # starts the thread blocked in nvmlEventSetWait
        N.events.append((1, 79))
        import time

        end = time.monotonic() + 3
        while not firing(book, "XidError") and time.monotonic() < end:
            time.sleep(0.01)
        [a] = firing(book, "XidError")
        assert a.key == "1:79" and a.severity == "critical"
        assert "fallen off the bus" in a.summary and "reboot" in a.fix
        assert w.counts == {1: {"79": 1}}
        clock.t += 101
        w.check()
        assert not firing(book, "XidError")
    finally:
        w.stop()


# --------------------------------------------------------------------- GPU processes
def gp_proc(pid, name, cmdline, mem=None, gpus=(0,), ancestors=(), unit=None, container=None, source="nvml",
            devices=("/dev/nvidia0", "/dev/nvidiactl")):
    from zerod.checks.gpu_processes import GpuProcess

    return GpuProcess(pid=pid, name=name, cmdline=cmdline, user="root", ppid=ancestors[0] if ancestors else 1,
                      ancestors=list(ancestors), gpus=list(gpus), gpu_memory_bytes=mem, unit=unit,
                      container=container, source=source, devices=list(devices))


def test_foreign_process_alert_names_pid_cmdline_unit_memory_and_agent_fix():
    me = os.getpid()
    procs = [
        gp_proc(me, "zerod", "python3 -m zerod run", source="fd"),
        gp_proc(4242, "python3", "python3 -m zerod serve --model x", mem=120 << 30, ancestors=(me,)),
        gp_proc(2211, "dcgm-exporter", "/usr/bin/dcgm-exporter -c 1000", mem=None, source="fd",
                unit="dcgm-exporter.service"),
        gp_proc(3000, "nvidia-persistenced", "/usr/bin/nvidia-persistenced", source="fd"),
    ]
    book, clock = AlertBook(), Clock()
    w = GpuProcessWatcher(book, cfg(), own_pids=lambda: {me}, engine_pid=lambda: 4242,
                          scan=lambda **kw: list(procs), clock=clock)
    w.poll()
    roles = {r["pid"]: r["role"] for r in w.snapshot()["processes"]}
    assert roles == {me: "daemon", 4242: "engine", 2211: "foreign", 3000: "allowed"}
    [a] = firing(book, "ForeignGpuProcess")
    assert a.key == "2211" and a.labels["pid"] == "2211" and a.labels["process"] == "dcgm-exporter"
    assert a.labels["unit"] == "dcgm-exporter.service"
    assert "dcgm-exporter (pid 2211) holds GPU 0" == a.summary
    assert "/usr/bin/dcgm-exporter -c 1000" in a.description and "unit dcgm-exporter.service" in a.description
    assert "dcgm-exporter" in a.fix
    row = next(r for r in w.rows if r["pid"] == 2211)
    assert row["known_agent"] == "dcgm-exporter" and row["first_seen"] == 1000.0
    # a process with memory, in a container, no known agent
    procs.append(gp_proc(5555, "python3", "python3 train.py", mem=2 << 30, container="docker:0123456789ab"))
    w.poll()
    a = book.get("ForeignGpuProcess", "5555")
    assert "2.00 GiB" in a.description and "container docker:0123456789ab" in a.description
    assert "allowed_gpu_processes" in a.fix
    # it goes away: resolved; kept as a recent foreign process for the latency watcher
    procs.pop()
    w.poll()
    assert book.get("ForeignGpuProcess", "5555") is None and 5555 in w.recent_foreign


def test_foreign_severity_follows_the_evidence():
    """A CUDA context or GPU memory: critical; an NVML reader (fd scan only): warning,
    unless NVML's lists could not be read (then a context may be there unseen)."""
    procs = [gp_proc(2211, "dcgm-exporter", "/usr/bin/dcgm-exporter", source="fd"),
             gp_proc(5555, "python3", "python3 train.py", mem=2 << 30),
             gp_proc(6666, "python3", "python3 ctx.py", mem=None, source="nvml")]
    book = AlertBook()
    nvml_up = [True]
    w = GpuProcessWatcher(book, cfg(), own_pids=lambda: set(), engine_pid=lambda: None,
                          nvml_ok=lambda: nvml_up[0], scan=lambda **kw: list(procs))
    w.poll()
    sev = {a.key: a.severity for a in firing(book, "ForeignGpuProcess")}
    assert sev == {"2211": "warning", "5555": "critical", "6666": "critical"}
    assert "an NVML reader, harmless to latency" in book.get("ForeignGpuProcess", "2211").description
    assert "steals memory and SM time" in book.get("ForeignGpuProcess", "5555").description
    assert w.recent_foreign[2211]["holds_context"] is False and w.recent_foreign[5555]["holds_context"]
    nvml_up[0] = False
    w.poll()
    assert book.get("ForeignGpuProcess", "2211").severity == "critical"


def test_allowed_processes_from_doctor_config_are_not_foreign():
    procs = [gp_proc(7, "my-sidecar", "/opt/sidecar/bin/my-sidecar", mem=1 << 30)]
    book = AlertBook()
    w = GpuProcessWatcher(book, cfg(), allowed=("my-sidecar",), own_pids=lambda: set(),
                          engine_pid=lambda: None, scan=lambda **kw: procs)
    w.poll()
    assert w.rows[0]["role"] == "allowed" and not book.firing()


def test_fd_scan_of_a_fake_proc_tree_finds_an_nvml_only_agent(tmp_path):
    """The real scan (zerod.checks.gpu_processes) over a /proc tree of files and
    symlinks: a process that only holds /dev/nvidiactl (an agent's nvmlInit) is found."""
    from zerod.checks.facts import Roots

    proc = tmp_path / "proc"
    pid = proc / "488"
    (pid / "fd").mkdir(parents=True)
    os.symlink("/dev/nvidiactl", pid / "fd" / "3")
    os.symlink("/dev/nvidia0", pid / "fd" / "4")
    os.symlink("/dev/null", pid / "fd" / "0")
    (pid / "comm").write_text("datadog-agent\n")
    (pid / "cmdline").write_text("/opt/datadog-agent/bin/agent/agent\0run\0")
    (pid / "status").write_text("Name:\tdatadog-agent\nUid:\t0\t0\t0\t0\n")
    (pid / "stat").write_text("488 (datadog-agent) S 1 488 488 0 -1 0 0 0\n")
    (pid / "cgroup").write_text("0::/system.slice/datadog-agent.service\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    roots = Roots.make(procfs=str(proc), rootfs=str(tmp_path))
    book = AlertBook()
    w = GpuProcessWatcher(book, cfg(), own_pids=lambda: set(), engine_pid=lambda: None,
                          nvml_ok=lambda: False, roots=roots)
    w.poll()
    [a] = firing(book, "ForeignGpuProcess")
    assert a.summary == "datadog-agent (pid 488) holds GPU 0"
    assert "datadog-agent.service" in a.description and "fd scan" in a.description
    assert "nvml.d" in a.fix  # the Datadog NVML check's fix


# --------------------------------------------------------------------- engine metrics + latency
def metrics_text(itl_counts, ttft_counts, retries=0, ooms=0, errors=0, gen=0):
    les = ["0.005", "0.01", "0.05", "0.1", "0.5", "+Inf"]
    lines = ["# HELP x y", "# TYPE zerod_engine_requests_running gauge", "zerod_engine_requests_running 3.0",
             "zerod_engine_requests_waiting 1.0", "zerod_engine_kv_pages_total 100.0",
             "zerod_engine_kv_pages_free 40.0", f"zerod_engine_allocator_retries_total {retries}",
             f"zerod_engine_allocator_ooms_total {ooms}", f"zerod_engine_stream_errors_total {errors}",
             f"zerod_engine_generation_tokens_total {gen}",
             'zerod_engine_requests_total{finished_reason="stop"} 4.0']
    for name, counts in (("inter_token_latency", itl_counts), ("time_to_first_token", ttft_counts)):
        for le, c in zip(les, counts):
            lines.append(f'zerod_engine_{name}_seconds_bucket{{le="{le}"}} {c}')
        lines.append(f"zerod_engine_{name}_seconds_count {counts[-1]}")
        lines.append(f"zerod_engine_{name}_seconds_sum 1.0")
    return "\n".join(lines) + "\n"


def test_parse_metrics_and_histogram_quantile():
    values, ttft, itl = parse_metrics(metrics_text([10, 50, 90, 99, 100, 100], [0, 0, 5, 10, 10, 10]))
    assert values["zerod_engine_requests_running"] == 3.0 and values["zerod_engine_kv_pages_free"] == 40.0
    assert itl.count == 100 and itl.buckets[float("inf")] == 100
    assert itl.quantile(0.5) == pytest.approx(0.005 + 0.005 * (50 - 10) / 40)  # inside (0.005, 0.01]
    assert itl.quantile(0.99) == pytest.approx(0.1)
    assert ttft.quantile(0.5) == pytest.approx(0.01 + 0.04 * 0.5 / 0.5 * (5 - 0) / 5)
    assert Histogram().quantile(0.99) is None


def test_allocator_and_stream_error_alerts_on_increase_only():
    book, clock = AlertBook(), Clock()
    w = EngineMetricsWatcher(book, cfg(counter_alert_hold_s=60), "http://x", engine_pid=lambda: 1, clock=clock)
    w.ingest(metrics_text([0] * 6, [0] * 6), pid=1)
    assert not book.firing()
    clock.t += 1
    w.ingest(metrics_text([0] * 6, [0] * 6, retries=2), pid=1)
    [a] = firing(book, "AllocatorRetries")
    assert "+2 retries" in a.summary
    clock.t += 1
    w.ingest(metrics_text([0] * 6, [0] * 6, retries=2, errors=1), pid=1)
    assert firing(book, "StreamErrors") and firing(book, "AllocatorRetries")
    clock.t += 61
    w.ingest(metrics_text([0] * 6, [0] * 6, retries=2, errors=1), pid=1)
    assert not book.firing()
    # a restarted engine starts its counters at zero: not an increase, not a decrease
    clock.t += 1
    w.ingest(metrics_text([0] * 6, [0] * 6), pid=2)
    assert not book.firing()


def test_latency_regression_names_the_foreign_process_that_appeared_before():
    """The source document's incident: a monitoring agent starts polling the GPU
    and p99 ITL goes from ~9 ms to 320 ms; zerod names the agent."""
    book, clock = AlertBook(), Clock(10_000.0)
    c = cfg(slo_itl_p99_s=0.1, latency_window_s=60, latency_min_samples=20, cause_window_s=300)
    m = EngineMetricsWatcher(book, c, "http://x", engine_pid=lambda: 1, clock=clock)
    recent = []
    lat = LatencyWatcher(book, c, m, recent_foreign=lambda: recent, clock=clock)
    # a healthy minute: every ITL under 10 ms
    itl = [0, 0, 0, 0, 0, 0]
    for i in range(61):
        itl = [x + 100 for x in itl[:1]] + [x + 100 for x in itl[1:]]
        m.ingest(metrics_text(list(itl), [0, 0, 1, 1, 1, 1], gen=i * 100), pid=1)
        lat.update()
        clock.t += 1
    f = lat.figures
    assert f["itl_p99_s"] is not None and f["itl_p99_s"] <= 0.005 and not book.firing()
    assert f["output_tokens_per_s"] == pytest.approx(100.0)
    # the agent appears …
    recent.append({"pid": 488, "name": "datadog-agent", "cmdline": "/opt/datadog-agent/bin/agent/agent run",
                   "unit": "datadog-agent.service", "container": None, "gpu": 0, "first_seen": clock.t,
                   "last_seen": clock.t, "fix": "disable its GPU check"})
    clock.t += 5
    # … and from now on ITLs land in (0.1, 0.5]
    for _ in range(30):
        itl = [itl[0], itl[1], itl[2], itl[3], itl[4] + 100, itl[5] + 100]
        m.ingest(metrics_text(list(itl), [0, 0, 1, 1, 1, 1]), pid=1)
        lat.update()
        clock.t += 1
    [a] = firing(book, "LatencyRegression")
    assert a.key == "itl" and "likely cause: datadog-agent (pid 488)" in a.summary
    assert "datadog-agent.service" in a.description and "before the regression began" in a.description
    assert a.fix == "disable its GPU check" and a.labels["cause_pid"] == "488"
    assert a.labels["slo"] == "itl_p99" and a.labels["process"] == "datadog-agent"  # what zerod top reads
    assert lat.snapshot()["itl_p99_s"] > 0.1 and len(lat.snapshot()["history"]["itl_p99_s"]) == 91


def test_cheap_check_between_full_scans_triggers_a_scan_on_change(tmp_path):
    """Between full scans only new pids and NVML's lists are looked at: a new
    pid holding /dev/nvidia* triggers a full scan at once; nothing new, none."""
    from zerod.checks.facts import Roots

    proc = tmp_path / "proc"
    proc.mkdir()

    def add(pid, name, dev):
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        os.symlink(dev, d / "fd" / "3")
        (d / "comm").write_text(name + "\n")
        (d / "cmdline").write_text(name + "\0")
        (d / "status").write_text("Uid:\t0\t0\t0\t0\n")
        (d / "stat").write_text(f"{pid} ({name}) S 1 1 1 0 -1 0\n")
        (d / "cgroup").write_text("0::/\n")

    add(10, "bash", "/dev/null")
    roots = Roots.make(procfs=str(proc), rootfs=str(tmp_path))
    book = AlertBook()
    w = GpuProcessWatcher(book, DaemonConfig.from_dict({"full_scan_interval_s": 60}), own_pids=lambda: set(),
                          engine_pid=lambda: None, nvml_ok=lambda: False, roots=roots)
    w.poll()
    assert w.full_scans == 1 and w.last_full_reason == "first scan"
    w.poll()
    assert w.full_scans == 1  # nothing changed: no full scan
    add(20, "nvtop", "/dev/null")  # starts without the GPU …
    w.poll()
    assert w.full_scans == 1
    os.unlink(proc / "20" / "fd" / "3")
    os.symlink("/dev/nvidiactl", proc / "20" / "fd" / "3")  # … and opens it a tick later
    w.poll()
    assert w.full_scans == 2 and w.last_full_reason == "new pid 20 holds /dev/nvidia*"
    [a] = firing(book, "ForeignGpuProcess")
    assert a.key == "20"
    import shutil

    shutil.rmtree(proc / "20")
    w.poll()
    assert w.last_full_reason == "a holder is gone" and not firing(book, "ForeignGpuProcess")
    # NVML lists a process the last scan did not see
    N = fake_nvml(1)
    N.nvmlDeviceGetComputeRunningProcesses = lambda g: [types.SimpleNamespace(pid=30, usedGpuMemory=1 << 30)]
    N.nvmlDeviceGetGraphicsRunningProcesses = lambda g: []
    s = NvmlSession(N)
    assert s.ensure()
    w.nvml_session = s
    w.poll()
    assert w.last_full_reason == "NVML lists a new process"


def test_process_rows_carry_host_cpu_rss_start_and_parent():
    """GET /v1/processes' host side, refreshed every tick (between full scans too): CPU %
    from the second tick on, RSS, start time, parent; nulls for a pid psutil cannot read."""
    import psutil

    me = os.getpid()
    procs = [gp_proc(me, "python3", "python3 -m pytest", mem=1 << 30), gp_proc(4242424, "gone", "gone")]
    w = GpuProcessWatcher(AlertBook(), cfg(), own_pids=lambda: set(), engine_pid=lambda: None,
                          scan=lambda **kw: list(procs))
    w.poll()
    rows = {r["pid"]: r for r in w.snapshot()["processes"]}
    assert rows[me]["cpu_percent"] is None  # the first tick only starts the measurement
    assert rows[me]["rss_bytes"] == pytest.approx(psutil.Process(me).memory_info().rss, rel=0.5)
    assert rows[me]["started_at"] == psutil.Process(me).create_time()
    assert rows[me]["ppid"] == os.getppid() and rows[me]["parent_name"] == psutil.Process(os.getppid()).name()
    assert all(rows[4242424][k] is None for k in ("cpu_percent", "rss_bytes", "started_at", "ppid"))
    sum(i * i for i in range(200_000))  # some CPU time between the ticks
    w.poll()
    mine = next(r for r in w.snapshot()["processes"] if r["pid"] == me)
    assert mine["cpu_percent"] is not None and mine["cpu_percent"] >= 0.0
