"""The daemon's /metrics and /v1/gpus over the views: the documented names,
gpu/uuid labels and never a pid, collected from snapshots at scrape time, XID
counts merged into the GPU rows once, and `promtool check metrics` passes."""

from __future__ import annotations

from pathlib import Path

import shutil
import subprocess

import pytest

from zerod.alerts import AlertBook
from zerod.checks.gpu_processes import GpuProcess
from zerod.daemon_config import DaemonConfig
from zerod.daemon_metrics import make_registry, render
from zerod.preflight import Preflight
from zerod.supervisor import EngineSupervisor
from zerod.views import EngineView, Views
from zerod.watchers.engine_metrics import EngineMetricsWatcher
from zerod.watchers.gpu_processes import GpuProcessWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.nvml_gpm import GpmWatcher
from zerod.watchers.nvml_session import NvmlSession
from zerod.diag.service import DiagService
from zerod.watchers.nvml_stats import NvmlStatsWatcher
from zerod.watchers.xid_events import XidWatcher
from test_daemon_watchers import fake_nvml  # noqa: E402  (same folder)


def _views(nvml=None) -> Views:
    """The daemon's views over real watchers fed by a fake pynvml and recorded rows."""
    book, cfg = AlertBook(), DaemonConfig.from_dict({"metrics_port": 0, "full_scan_interval_s": 0})
    session = NvmlSession(nvml or fake_nvml(2))
    nvml_stats = NvmlStatsWatcher(session, book, cfg)
    xid = XidWatcher(session, book, cfg)
    procs = [GpuProcess(pid=2211, name="dcgm-exporter", cmdline="/usr/bin/dcgm-exporter", gpus=[0],
                        gpu_memory_bytes=1 << 30, source="nvml")]
    processes = GpuProcessWatcher(book, cfg, own_pids=set, engine_pid=lambda: None, scan=lambda **kw: procs)
    sup = EngineSupervisor(["true"], "http://127.0.0.1:1", cfg, book)
    engine_metrics = EngineMetricsWatcher(book, cfg, sup.url, engine_pid=lambda: None)
    latency = LatencyWatcher(book, cfg, engine_metrics)
    engine = EngineView(sup, engine_metrics, latency, Preflight({}, book, enabled=False))
    views = Views("gpu-host-1", 1000.0, False, book, nvml_stats, xid, processes,
                  [nvml_stats, processes, xid, engine_metrics, latency], [engine])
    views.gpm = GpmWatcher(session, cfg)
    views.watchers.append(views.gpm)
    views.diag = DiagService(book, Path("/nonexistent/zerod-diag.json"), engines=lambda: [])
    nvml_stats.poll()
    xid.record(1, 79)
    processes.poll()
    return views


def test_metric_names_labels_and_values():
    v = _views()
    text = render(make_registry(v)).decode()
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
    v = _views()
    reg = make_registry(v)
    v.nvml_stats.gpus[0].temperature_celsius = 77
    assert 'zerod_gpu_temperature_celsius{gpu="0",uuid="GPU-0000"} 77.0' in render(reg).decode()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_check_metrics():
    text = render(make_registry(_views())).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gpus_doc_carries_each_gpu_s_xid_counts_once():
    v = _views()
    doc = v.gpus()
    assert [g["xid_events_total"] for g in doc["gpus"]] == [{}, {"79": 1}]
    v.xid.record(1, 79)
    assert v.gpus()["gpus"][1]["xid_events_total"] == {"79": 2}
    assert "xid_events_total" not in v.nvml_stats.gpus[1].as_json()  # the XID watcher owns them


def test_a_lost_gpu_keeps_its_xid_series():
    nvml = fake_nvml(2)
    v = _views(nvml)
    nvml.gpus[1]["lost"] = True  # Xid 79: fallen off the bus
    v.nvml_stats.poll()
    text = render(make_registry(v)).decode()
    assert 'zerod_gpu_xid_events_total{gpu="1",uuid="GPU-0001",xid="79"} 1.0' in text
    assert 'zerod_gpu_temperature_celsius{gpu="1"' not in text


def test_daemon_scrape_has_build_info_and_no_created_series():
    from zerod import __version__

    text = render(make_registry(_views())).decode()
    assert 'zerod_build_info{component="daemon",python="' in text
    assert f'version="{__version__}"}} 1.0' in text
    assert "_created" not in text
