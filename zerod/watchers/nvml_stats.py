"""GPU health from NVML every second: utilization, memory, temperature, power,
clocks, clock event (throttle) reasons, PCIe replays, ECC and row remapping —
and what dcgm-exporter exports besides (zerod.watchers.nvml_reads): HBM
temperature, the energy counter, NVLink throughput and errors, compute mode,
per-process SM and memory utilization, MIG instances; a call the GPU or driver
does not support is skipped for that GPU from then on.

Alerts: `GpuThrottled` (a reason of `throttle_alert_reasons` active for
`throttle_for_s`), `GpuHot` (>= `temperature_max_celsius`), `EccErrors`
(volatile uncorrected errors, a pending or failed row remap), `PcieReplays`
(the replay counter went up; held `counter_alert_hold_s`), `NvmlUnavailable`
(NVML cannot start) and `GpuLost` (NVML_ERROR_GPU_IS_LOST) — never a crash.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zerod.alerts import AlertBook
from zerod.checks.clock_events import CLOCK_EVENT_REASONS, reasons_from_mask
from zerod.daemon_config import DaemonConfig
from zerod.watchers import Watcher
from zerod.checks.compute_mode import NAMES as MODE_NAMES
from zerod.checks.compute_mode import name as mode_name
from zerod.watchers.nvml_reads import NvmlReads
from zerod.watchers.nvml_session import NvmlSession, is_gpu_lost

HISTORY = 600
# (metric, help, key of the GPU row, scale)
GPU_GAUGES = (
    ("zerod_gpu_utilization_ratio", "GPU utilization (0-1) over NVML's last sample period.", "utilization_ratio", 1),
    ("zerod_gpu_memory_used_bytes", "GPU memory in use.", "memory_used_bytes", 1),
    ("zerod_gpu_memory_total_bytes", "GPU memory in all.", "memory_total_bytes", 1),
    ("zerod_gpu_temperature_celsius", "GPU temperature.", "temperature_celsius", 1),
    ("zerod_gpu_power_watts", "GPU board power draw.", "power_watts", 1),
    ("zerod_gpu_power_limit_watts", "GPU enforced power limit.", "power_limit_watts", 1),
    ("zerod_gpu_sm_clock_hertz", "GPU SM clock.", "sm_clock_mhz", 1e6),
    ("zerod_gpu_ecc_volatile_uncorrected_errors",
     "Uncorrected ECC errors since the last driver load (NVML volatile count).", "ecc_volatile_uncorrected", 1),
)
# dcgm-exporter's series, in Prometheus naming (the DCGM field each replaces: docs/daemon.md)
PARITY_GAUGES = (
    ("zerod_gpu_memory_clock_hertz", "GPU memory clock.", "mem_clock_mhz", 1e6),
    ("zerod_gpu_memory_temperature_celsius", "HBM temperature.", "memory_temperature_celsius", 1),
    ("zerod_gpu_memory_copy_utilization_ratio",
     "Share of NVML's last sample period the memory was read or written (DCGM_FI_DEV_MEM_COPY_UTIL).",
     "memory_copy_utilization_ratio", 1),
)
NVLINK_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")
_TEMPERATURE_GPU = 0
_CLOCK_SM, _CLOCK_MEM = 1, 2
_ECC_UNCORRECTED, _ECC_VOLATILE = 1, 0

REASON_FIX = {
    "hw_slowdown": "HW slowdown (thermal or power brake signal from the board): check cooling and the PSU; nvidia-smi -q -d PERFORMANCE",
    "hw_thermal_slowdown": "the GPU is too hot: check airflow and fans; nvidia-smi -q -d TEMPERATURE",
    "hw_power_brake_slowdown": "external power brake asserted: check the PSU / chassis power budget",
    "sw_thermal_slowdown": "the driver lowers clocks to stay under its thermal limit: check cooling",
    "sw_power_cap": "at the power limit: expected under full load; raise it with nvidia-smi -pl if the board allows",
}


class NvmlStatsWatcher(Watcher):
    name = "nvml_stats"

    def __init__(self, session: NvmlSession, book: AlertBook, cfg: DaemonConfig,
                 demo: bool = False, clock=time.time) -> None:
        super().__init__()
        self.session = session
        self.book = book
        self.cfg = cfg
        self.demo = demo
        self.clock = clock
        self.interval_s = cfg.watch_interval_s
        self.gpus: dict[int, dict[str, Any]] = {}
        self.reads: NvmlReads | None = None
        # GPU index -> {pid: (SM ratio, memory ratio)}: zerod.views meets it with the process rows
        self.process_utilization: dict[int, dict[int, tuple[float, float]]] = {}
        self.history: dict[int, dict[str, collections.deque]] = {}
        self._throttle_since: dict[tuple[int, str], float] = {}
        self._replays_seen: dict[int, int] = {}
        self._replay_alert_at: dict[int, float] = {}

    # the snapshot for /v1/gpus (zerod.views adds each GPU's XID counts)
    def snapshot(self) -> dict[str, Any]:
        gpus = []
        for idx in sorted(self.gpus):
            g = dict(self.gpus[idx])
            h = self.history.get(idx, {})
            g["history"] = {k: list(v) for k, v in h.items()}
            gpus.append(g)
        return {"nvml": {"ok": self.session.ok, "error": self.session.error,
                         "driver_version": self.session.driver_version}, "gpus": gpus}

    def collect(self):
        """The GPU series of /metrics, from the last poll: `gpu` and `uuid` labels, never a pid."""
        labels = ["gpu", "uuid"]
        families = [(GaugeMetricFamily(name, doc, labels=labels), key, scale)
                    for name, doc, key, scale in GPU_GAUGES + PARITY_GAUGES]
        events = GaugeMetricFamily("zerod_gpu_clock_event_active",
                                   "1 while NVML reports this clocks event (throttle) reason.",
                                   labels=labels + ["reason"])
        replays = CounterMetricFamily("zerod_gpu_pcie_replays", "PCIe replay counter (NVML).", labels=labels)
        energy = CounterMetricFamily("zerod_gpu_energy_joules", "Energy the GPU used since the driver loaded.",
                                     labels=labels)
        mode = GaugeMetricFamily("zerod_gpu_compute_mode",
                                 "NVML compute mode: 0 Default, 1 Exclusive_Thread, 2 Prohibited, 3 Exclusive_Process.",
                                 labels=labels)
        remapped = GaugeMetricFamily("zerod_gpu_remapped_rows", "Rows remapped, by the error that caused it.",
                                     labels=labels + ["cause"])
        pending = GaugeMetricFamily("zerod_gpu_row_remap_pending", "1 while a row remap waits for a GPU reset.",
                                    labels=labels)
        failed = GaugeMetricFamily("zerod_gpu_row_remap_failed", "1 when a row remap has failed.", labels=labels)
        nvlink = CounterMetricFamily("zerod_gpu_nvlink_bytes", "NVLink data bytes over every link.",
                                     labels=labels + ["direction"])
        nvlink_err = CounterMetricFamily("zerod_gpu_nvlink_errors", "NVLink errors over every link, by type.",
                                         labels=labels + ["type"])
        mig_on = GaugeMetricFamily("zerod_gpu_mig_enabled", "1 when MIG mode is enabled.", labels=labels)
        mig_mem = GaugeMetricFamily("zerod_gpu_mig_memory_used_bytes", "Memory in use in a MIG instance.",
                                    labels=labels + ["gpu_instance", "compute_instance"])
        mig_total = GaugeMetricFamily("zerod_gpu_mig_memory_total_bytes", "Memory of a MIG instance.",
                                      labels=labels + ["gpu_instance", "compute_instance"])
        for idx in sorted(self.gpus):
            g = self.gpus[idx]
            lv = [str(idx), g["uuid"]]
            for fam, key, scale in families:
                if g.get(key) is not None:
                    fam.add_metric(lv, float(g[key]) * scale)
            active = set(g.get("clock_events_active") or [])
            for reason in CLOCK_EVENT_REASONS.values():
                events.add_metric(lv + [reason], 1.0 if reason in active else 0.0)
            if g.get("pcie_replays_total") is not None:
                replays.add_metric(lv, float(g["pcie_replays_total"]))
            if g.get("energy_joules_total") is not None:
                energy.add_metric(lv, g["energy_joules_total"])
            if g.get("compute_mode") is not None:
                mode.add_metric(lv, float(next(k for k, v in MODE_NAMES.items() if v == g["compute_mode"])))
            rr = g.get("remapped_rows")
            if rr is not None:
                remapped.add_metric(lv + ["correctable"], float(rr["corrected"]))
                remapped.add_metric(lv + ["uncorrectable"], float(rr["uncorrected"]))
                pending.add_metric(lv, float(rr["pending"]))
                failed.add_metric(lv, float(rr["failure"]))
            nv = g.get("nvlink")
            if nv is not None:
                for direction in ("tx", "rx"):
                    if nv[f"{direction}_bytes_total"] is not None:
                        nvlink.add_metric(lv + [direction], float(nv[f"{direction}_bytes_total"]))
                for kind, n in nv["errors_total"].items():
                    nvlink_err.add_metric(lv + [kind], float(n))
            if g.get("mig_enabled") is not None:
                mig_on.add_metric(lv, float(g["mig_enabled"]))
            for m in g.get("mig_instances") or []:
                ids = [str(m["gpu_instance"]), str(m["compute_instance"])]
                if m["memory_used_bytes"] is not None:
                    mig_mem.add_metric(lv + ids, float(m["memory_used_bytes"]))
                    mig_total.add_metric(lv + ids, float(m["memory_total_bytes"]))
        yield from (fam for fam, _, _ in families)
        yield from (events, replays, energy, mode, remapped, pending, failed, nvlink, nvlink_err,
                    mig_on, mig_mem, mig_total)
        yield GaugeMetricFamily("zerod_nvml_up", "1 when NVML answers (0: no driver, library or GPU).",
                                value=1.0 if self.session.ok else 0.0)

    def poll(self) -> None:
        if not self.session.ensure():
            self.book.fire("NvmlUnavailable", severity="info" if self.demo else "critical",
                           summary="NVML unavailable: GPUs are not watched",
                           description=f"{self.session.error}"
                                       + (" (expected with --demo on a machine without a GPU)" if self.demo else ""),
                           fix="nvidia-smi must work on this host: install or load the NVIDIA driver")
            return
        self.book.resolve("NvmlUnavailable")
        lost_now: dict[str, dict[str, Any]] = {}
        for dev in list(self.session.devices):
            try:
                self._poll_device(dev)
            except Exception as exc:
                if is_gpu_lost(exc):
                    self.session.lost.add(dev.index)
                    self.gpus.pop(dev.index, None)
                    self.process_utilization.pop(dev.index, None)
                    lost_now[str(dev.index)] = dict(
                        severity="critical", summary=f"GPU {dev.index} ({dev.uuid}) is lost",
                        description="NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus or stopped answering; "
                                    "the engine on it cannot work",
                        labels={"gpu": dev.index, "uuid": dev.uuid},
                        fix="drain the host and reboot; check the kernel log for Xid 79 and the PCIe/power path")
                else:
                    raise
        # a lost GPU stays lost until NVML is re-initialised
        for idx in self.session.lost:
            if str(idx) not in lost_now:
                dev = self.session.device(idx)
                lost_now[str(idx)] = dict(severity="critical", summary=f"GPU {idx} is lost",
                                          labels={"gpu": idx, "uuid": dev.uuid if dev else None},
                                          fix="drain the host and reboot")
        self.book.sync("GpuLost", lost_now)

    def _poll_device(self, dev) -> None:
        N = self.session.nvml
        if self.reads is None or self.reads.N is not N:
            self.reads = NvmlReads(N)
        r, h, i = self.reads, dev.handle, dev.index
        now = self.clock()

        def opt(name, *args):
            return r.call(i, name, h, *args)

        util = opt("nvmlDeviceGetUtilizationRates")
        mem = N.nvmlDeviceGetMemoryInfo(h)  # the one call that must work (GPU lost shows here)
        temp = opt("nvmlDeviceGetTemperature", _TEMPERATURE_GPU)
        power_mw = opt("nvmlDeviceGetPowerUsage")
        limit_mw = opt("nvmlDeviceGetEnforcedPowerLimit")
        sm = opt("nvmlDeviceGetClockInfo", _CLOCK_SM)
        memclk = opt("nvmlDeviceGetClockInfo", _CLOCK_MEM)
        reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons" if hasattr(N, "nvmlDeviceGetCurrentClocksEventReasons") \
            else "nvmlDeviceGetCurrentClocksThrottleReasons"
        mask = opt(reasons_fn)
        replays = opt("nvmlDeviceGetPcieReplayCounter")
        ecc = opt("nvmlDeviceGetTotalEccErrors", _ECC_UNCORRECTED, _ECC_VOLATILE)
        remap = opt("nvmlDeviceGetRemappedRows")  # (corrected, uncorrected, pending, failure)
        energy_mj = opt("nvmlDeviceGetTotalEnergyConsumption")
        mode = opt("nvmlDeviceGetComputeMode")
        fields = r.fields(i, h)
        mig_enabled, mig = r.mig(i, h)
        self.process_utilization[i] = r.process_utilization(i, h)
        reasons = reasons_from_mask(int(mask)) if mask is not None else []
        g = {
            "index": dev.index, "uuid": dev.uuid, "name": dev.name,
            "utilization_ratio": (util.gpu / 100.0) if util is not None else None,
            "memory_copy_utilization_ratio": (util.memory / 100.0) if util is not None else None,
            "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total),
            "temperature_celsius": int(temp) if temp is not None else None,
            "power_watts": power_mw / 1000.0 if power_mw is not None else None,
            "power_limit_watts": limit_mw / 1000.0 if limit_mw is not None else None,
            "sm_clock_mhz": sm, "mem_clock_mhz": memclk,
            "clock_events_active": reasons,
            "pcie_replays_total": int(replays) if replays is not None else None,
            "ecc_volatile_uncorrected": int(ecc) if ecc is not None else None,
            "remapped_rows": ({"corrected": int(remap[0]), "uncorrected": int(remap[1]),
                               "pending": bool(remap[2]), "failure": bool(remap[3])}
                              if remap is not None else None),
            "memory_temperature_celsius": fields.get("memory_temperature_celsius"),
            "energy_joules_total": energy_mj / 1000.0 if energy_mj is not None else None,
            "compute_mode": mode_name(mode) if mode is not None else None,
            "nvlink": ({"tx_bytes_total": int(fields["nvlink_tx_kib"] * 1024) if "nvlink_tx_kib" in fields else None,
                        "rx_bytes_total": int(fields["nvlink_rx_kib"] * 1024) if "nvlink_rx_kib" in fields else None,
                        "errors_total": {k: int(fields[f"nvlink_{k}_errors"]) for k in NVLINK_ERRORS
                                         if f"nvlink_{k}_errors" in fields}}
                       if any(k.startswith("nvlink_") for k in fields) else None),
            "mig_enabled": mig_enabled, "mig_instances": mig,
        }
        self.gpus[dev.index] = g
        hist = self.history.setdefault(dev.index, {k: collections.deque(maxlen=HISTORY) for k in (
            "utilization_ratio", "memory_used_bytes", "temperature_celsius", "power_watts")})
        for k, dq in hist.items():
            dq.append(g[k])
        self._alerts(dev, g, now)

    def _alerts(self, dev, g: dict[str, Any], now: float) -> None:
        idx, labels = dev.index, {"gpu": dev.index, "uuid": dev.uuid}
        key = str(idx)
        # throttling that matters, held for throttle_for_s
        active = [r for r in g["clock_events_active"] if r in self.cfg.throttle_alert_reasons]
        for r in CLOCK_EVENT_REASONS.values():
            if r in active:
                self._throttle_since.setdefault((idx, r), now)
            else:
                self._throttle_since.pop((idx, r), None)
        held = [r for r in active if now - self._throttle_since[(idx, r)] >= self.cfg.throttle_for_s]
        if held:
            self.book.fire("GpuThrottled", key, severity="warning",
                           summary=f"GPU {idx} clocks held down: {', '.join(held)}",
                           description=f"SM clock {g['sm_clock_mhz']} MHz, {g['temperature_celsius']} °C, "
                                       f"{g['power_watts']} W of {g['power_limit_watts']} W",
                           labels={**labels, "reasons": ",".join(held)},
                           fix="; ".join(REASON_FIX.get(r, r) for r in held))
        else:
            self.book.resolve("GpuThrottled", key)
        # temperature
        t = g["temperature_celsius"]
        if t is not None and t >= self.cfg.temperature_max_celsius:
            self.book.fire("GpuHot", key, severity="warning",
                           summary=f"GPU {idx} at {t} °C (limit {self.cfg.temperature_max_celsius:.0f} °C)",
                           labels=labels, fix="check airflow, fans and inlet temperature")
        elif t is not None and t < self.cfg.temperature_max_celsius - 3:  # hysteresis
            self.book.resolve("GpuHot", key)
        # ECC and row remapping
        problems = []
        if g["ecc_volatile_uncorrected"]:
            problems.append(f"{g['ecc_volatile_uncorrected']} volatile uncorrected ECC error(s)")
        rr = g["remapped_rows"]
        if rr and rr["pending"]:
            problems.append("a row remap is pending (applied at the next GPU reset)")
        if rr and rr["failure"]:
            problems.append("a row remap failed")
        if problems:
            self.book.fire("EccErrors", key, severity="critical",
                           summary=f"GPU {idx}: {'; '.join(problems)}", labels=labels,
                           fix="drain the GPU and reset it (nvidia-smi -r -i %d); a failed remap means RMA" % idx)
        else:
            self.book.resolve("EccErrors", key)
        # PCIe replays: any increase, held for counter_alert_hold_s
        r = g["pcie_replays_total"]
        if r is not None:
            prev = self._replays_seen.get(idx)
            self._replays_seen[idx] = r
            if prev is not None and r > prev:
                self._replay_alert_at[idx] = now
                self.book.fire("PcieReplays", key, severity="warning",
                               summary=f"GPU {idx}: {r - prev} PCIe replay(s) in the last {self.interval_s:.0f} s ({r} in all)",
                               labels=labels,
                               fix="check the PCIe link (nvidia-smi -q -d PCIE: width/generation), riser and seating")
            elif idx in self._replay_alert_at and now - self._replay_alert_at[idx] >= self.cfg.counter_alert_hold_s:
                del self._replay_alert_at[idx]
                self.book.resolve("PcieReplays", key)
