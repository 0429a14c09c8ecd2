"""The daemon's Prometheus metrics, collected at scrape time from the watchers'
cached snapshots (a custom collector: nothing updates a gauge from a loop).

Names as in DESIGN.md; GPU series carry `gpu` (index) and `uuid`; never a pid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.process_collector import ProcessCollector

from zerod import __version__
from zerod.watchers.nvml_stats import CLOCK_EVENT_REASONS

if TYPE_CHECKING:  # pragma: no cover
    from zerod.daemon import Daemon

CHECK_STATUS_VALUE = {"pass": 0, "skip": 0, "warn": 1, "error": 1, "fail": 2}


class DaemonCollector:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon

    def describe(self):
        return []

    def collect(self):
        d = self.d
        yield InfoMetricFamily("zerod", "zerod build information.", value={"version": __version__})
        # --- GPUs (nvml_stats, xid_events)
        g_labels = ["gpu", "uuid"]
        util = GaugeMetricFamily("zerod_gpu_utilization_ratio", "GPU utilization (0-1) over NVML's last sample period.", labels=g_labels)
        mem = GaugeMetricFamily("zerod_gpu_memory_used_bytes", "GPU memory in use.", labels=g_labels)
        memt = GaugeMetricFamily("zerod_gpu_memory_total_bytes", "GPU memory in all.", labels=g_labels)
        temp = GaugeMetricFamily("zerod_gpu_temperature_celsius", "GPU temperature.", labels=g_labels)
        power = GaugeMetricFamily("zerod_gpu_power_watts", "GPU board power draw.", labels=g_labels)
        plimit = GaugeMetricFamily("zerod_gpu_power_limit_watts", "GPU enforced power limit.", labels=g_labels)
        sm = GaugeMetricFamily("zerod_gpu_sm_clock_hertz", "GPU SM clock.", labels=g_labels)
        events = GaugeMetricFamily("zerod_gpu_clock_event_active",
                                   "1 while NVML reports this clocks event (throttle) reason.",
                                   labels=g_labels + ["reason"])
        replays = CounterMetricFamily("zerod_gpu_pcie_replays", "PCIe replay counter (NVML).", labels=g_labels)
        ecc = GaugeMetricFamily("zerod_gpu_ecc_volatile_uncorrected_errors",
                                "Uncorrected ECC errors since the last driver load (NVML volatile count).",
                                labels=g_labels)
        xid = CounterMetricFamily("zerod_gpu_xid_events", "XID events received from NVML since the daemon started.",
                                  labels=g_labels + ["xid"])
        for g in d.gpu_rows():
            lv = [str(g["index"]), g["uuid"]]
            for fam, key, scale in ((util, "utilization_ratio", 1), (mem, "memory_used_bytes", 1),
                                    (memt, "memory_total_bytes", 1), (temp, "temperature_celsius", 1),
                                    (power, "power_watts", 1), (plimit, "power_limit_watts", 1),
                                    (sm, "sm_clock_mhz", 1e6), (ecc, "ecc_volatile_uncorrected", 1)):
                if g.get(key) is not None:
                    fam.add_metric(lv, float(g[key]) * scale)
            active = set(g.get("clock_events_active") or [])
            for reason in CLOCK_EVENT_REASONS.values():
                events.add_metric(lv + [reason], 1.0 if reason in active else 0.0)
            if g.get("pcie_replays_total") is not None:
                replays.add_metric(lv, float(g["pcie_replays_total"]))
            for code, n in sorted((g.get("xid_events_total") or {}).items()):
                xid.add_metric(lv + [str(code)], float(n))
        yield from (util, mem, memt, temp, power, plimit, sm, events, replays, ecc, xid)
        # --- NVML itself
        yield GaugeMetricFamily("zerod_nvml_up", "1 when NVML answers (0: no driver, library or GPU).",
                                value=1.0 if d.nvml.ok else 0.0)
        # --- processes
        foreign = d.processes.foreign() if d.processes else []
        yield GaugeMetricFamily("zerod_foreign_gpu_processes",
                                "Processes holding a GPU that are neither the engine nor allowed.",
                                value=float(len(foreign)))
        yield GaugeMetricFamily("zerod_foreign_gpu_memory_bytes", "GPU memory held by foreign processes.",
                                value=float(sum(r["gpu_memory_bytes"] or 0 for r in foreign)))
        # --- checks
        cs = GaugeMetricFamily("zerod_check_status",
                               "Last preflight result per check: 0 pass or skip, 1 warn or error, 2 fail.",
                               labels=["check"])
        for c in d.check_rows():
            cs.add_metric([c["id"]], float(CHECK_STATUS_VALUE.get(c["status"], 1)))
        yield cs
        # --- alerts
        af = GaugeMetricFamily("zerod_alerts_firing", "Alerts firing now, by name.", labels=["alertname"])
        for name, n in sorted(d.book.firing_counts().items()):
            af.add_metric([name], float(n))
        yield af
        # --- the engine
        eng = d.supervisor.snapshot() if d.supervisor else {"up": False, "restarts": 0}
        yield GaugeMetricFamily("zerod_engine_up", "1 while the engine answers its health check.",
                                value=1.0 if eng["up"] else 0.0)
        yield CounterMetricFamily("zerod_engine_restarts", "Engine restarts by the daemon.",
                                  value=float(eng["restarts"]))
        # --- the daemon's own watchers
        wr = CounterMetricFamily("zerod_watcher_runs", "Watcher polls.", labels=["watcher"])
        we = CounterMetricFamily("zerod_watcher_errors", "Watcher polls that failed.", labels=["watcher"])
        wb = CounterMetricFamily("zerod_watcher_busy_seconds", "Wall time spent in watcher polls.", labels=["watcher"])
        for w in d.watchers:
            wr.add_metric([w.name], float(w.runs))
            we.add_metric([w.name], float(w.errors))
            wb.add_metric([w.name], float(w.busy_s))
        yield from (wr, we, wb)


def make_registry(daemon: "Daemon") -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector(daemon))
    ProcessCollector(registry=reg, namespace="zerod")  # zerod_process_cpu_seconds_total …
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
