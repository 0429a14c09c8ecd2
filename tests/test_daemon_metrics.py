"""The daemon's /metrics: DESIGN.md's names, gpu/uuid labels and never a pid,
collected from snapshots at scrape time, and `promtool check metrics` passes."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from zerod.daemon import Daemon
from zerod.daemon_metrics import make_registry, render
from test_daemon_watchers import fake_nvml  # noqa: E402  (same folder)
from zerod.checks.gpu_processes import GpuProcess


def _daemon():
    d = Daemon({"daemon": {"metrics_port": 0}, "engine": {}, "doctor": {}, "alerts": {}}, nvml=fake_nvml(2))
    from zerod.watchers.gpu_processes import GpuProcessWatcher
    from zerod.watchers.nvml_stats import NvmlStatsWatcher
    from zerod.watchers.xid_events import XidWatcher

    d.nvml_stats = NvmlStatsWatcher(d.nvml, d.book, d.cfg)
    d.xid = XidWatcher(d.nvml, d.book, d.cfg)
    procs = [GpuProcess(pid=2211, name="dcgm-exporter", cmdline="/usr/bin/dcgm-exporter", gpus=[0],
                        gpu_memory_bytes=1 << 30, source="nvml")]
    d.processes = GpuProcessWatcher(d.book, d.cfg, own_pids=lambda: set(), engine_pid=lambda: None,
                                    scan=lambda **kw: procs)
    d.watchers = [d.nvml_stats, d.processes, d.xid]
    d.nvml_stats.poll()
    d.xid.record(1, 79)
    d.processes.poll()
    return d


def test_metric_names_labels_and_values():
    d = _daemon()
    text = render(make_registry(d)).decode()
    for name in ("zerod_gpu_utilization_ratio", "zerod_gpu_memory_used_bytes", "zerod_gpu_temperature_celsius",
                 "zerod_gpu_power_watts", "zerod_gpu_clock_event_active", "zerod_gpu_xid_events_total",
                 "zerod_gpu_pcie_replays_total", "zerod_foreign_gpu_processes", "zerod_foreign_gpu_memory_bytes",
                 "zerod_check_status", "zerod_alerts_firing", "zerod_engine_up", "zerod_engine_restarts_total"):
        assert f"# TYPE {name} " in text, name
    assert 'zerod_gpu_utilization_ratio{gpu="0",uuid="GPU-0000"} 0.5' in text
    assert 'zerod_gpu_xid_events_total{gpu="1",uuid="GPU-0001",xid="79"} 1.0' in text
    assert 'zerod_gpu_clock_event_active{gpu="0",reason="hw_slowdown",uuid="GPU-0000"} 0.0' in text
    assert "zerod_foreign_gpu_processes 1.0" in text and "zerod_foreign_gpu_memory_bytes 1.073741824e+09" in text
    assert 'zerod_alerts_firing{alertname="ForeignGpuProcess"} 1.0' in text
    assert 'zerod_alerts_firing{alertname="XidError"} 1.0' in text
    assert "pid=" not in text


def test_scrape_reads_the_snapshot_not_the_host():
    d = _daemon()
    reg = make_registry(d)
    d.nvml_stats.gpus[0]["temperature_celsius"] = 77
    assert 'zerod_gpu_temperature_celsius{gpu="0",uuid="GPU-0000"} 77.0' in render(reg).decode()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_check_metrics():
    text = render(make_registry(_daemon())).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
