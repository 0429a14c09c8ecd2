"""GPU health from NVML every second: utilization, memory, temperature, power,
clocks, clock event (throttle) reasons, PCIe replays, ECC and row remapping —
and what dcgm-exporter exports besides: HBM temperature, the energy counter,
NVLink throughput and errors, compute mode, per-process SM and memory
utilization, MIG instances. The reading itself is zerod.checks.gpu_reading's (a
call the GPU or driver does not support is skipped for that GPU from then on);
this module keeps the last one per GPU, its history, its series and its alerts.

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
from zerod.checks.clock_events import CLOCK_EVENT_REASONS
from zerod.checks.gpu_reading import GpuReading, NvmlReader, is_gpu_lost
from zerod.daemon_config import DaemonConfig
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher
from zerod.watchers.nvml_session import NvmlSession

HISTORY = 600
# (metric, help, quantity of the GpuReading, scale)
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
)
HISTORY_QUANTITIES = ("utilization_ratio", "memory_used_bytes", "temperature_celsius", "power_watts")
CLOCK_EVENT_ACTIVE = "zerod_gpu_clock_event_active"
PCIE_REPLAYS = "zerod_gpu_pcie_replays"
ENERGY = "zerod_gpu_energy_joules"
COMPUTE_MODE = "zerod_gpu_compute_mode"
REMAPPED_ROWS = "zerod_gpu_remapped_rows"
REMAP_PENDING = "zerod_gpu_row_remap_pending"
REMAP_FAILED = "zerod_gpu_row_remap_failed"
NVLINK_BYTES = "zerod_gpu_nvlink_bytes"
NVLINK_ERRORS = "zerod_gpu_nvlink_errors"
MIG_ENABLED = "zerod_gpu_mig_enabled"
MIG_MEMORY_USED = "zerod_gpu_mig_memory_used_bytes"
MIG_MEMORY_TOTAL = "zerod_gpu_mig_memory_total_bytes"
NVML_UP = "zerod_nvml_up"
_MIG_IDS = ["gpu_instance", "compute_instance"]
# family -> (kind, help, labels beside gpu and uuid); the per-GPU gauges first, in their order
FAMILIES = {
    **{name: (GaugeMetricFamily, doc, []) for name, doc, _, _ in GPU_GAUGES + PARITY_GAUGES},
    CLOCK_EVENT_ACTIVE: (GaugeMetricFamily, "1 while NVML reports this clocks event (throttle) reason.", ["reason"]),
    PCIE_REPLAYS: (CounterMetricFamily, "PCIe replay counter (NVML).", []),
    ENERGY: (CounterMetricFamily, "Energy the GPU used since the driver loaded.", []),
    COMPUTE_MODE: (GaugeMetricFamily,
                   "NVML compute mode: 0 Default, 1 Exclusive_Thread, 2 Prohibited, 3 Exclusive_Process.", []),
    REMAPPED_ROWS: (GaugeMetricFamily, "Rows remapped, by the error that caused it.", ["cause"]),
    REMAP_PENDING: (GaugeMetricFamily, "1 while a row remap waits for a GPU reset.", []),
    REMAP_FAILED: (GaugeMetricFamily, "1 when a row remap has failed.", []),
    NVLINK_BYTES: (CounterMetricFamily, "NVLink data bytes over every link.", ["direction"]),
    NVLINK_ERRORS: (CounterMetricFamily, "NVLink errors over every link, by type.", ["type"]),
    MIG_ENABLED: (GaugeMetricFamily, "1 when MIG mode is enabled.", []),
    MIG_MEMORY_USED: (GaugeMetricFamily, "Memory in use in a MIG instance.", _MIG_IDS),
    MIG_MEMORY_TOTAL: (GaugeMetricFamily, "Memory of a MIG instance.", _MIG_IDS),
}

REASON_FIX = {
    "hw_slowdown": "HW slowdown (thermal or power brake signal from the board): check cooling and the PSU; nvidia-smi -q -d PERFORMANCE",
    "hw_thermal_slowdown": "the GPU is too hot: check airflow and fans; nvidia-smi -q -d TEMPERATURE",
    "hw_power_brake_slowdown": "external power brake asserted: check the PSU / chassis power budget",
    "sw_thermal_slowdown": "the driver lowers clocks to stay under its thermal limit: check cooling",
    "sw_power_cap": "at the power limit: expected under full load; raise it with nvidia-smi -pl if the board allows",
}


@owns(metrics=(*FAMILIES, NVML_UP), alerts=(
    AlertRule("GpuThrottled", "warning", "a reason of `throttle_alert_reasons` held `throttle_for_s` "
              "(`sw_power_cap` alone is normal under load)"),
    AlertRule("GpuHot", "warning", "GPU temperature at or above `temperature_max_celsius` (3 °C hysteresis)"),
    AlertRule("EccErrors", "critical", "volatile uncorrected ECC errors, a pending or a failed row remap"),
    AlertRule("PcieReplays", "warning", "the PCIe replay counter went up (held `counter_alert_hold_s`)"),
    AlertRule("NvmlUnavailable", "critical", "NVML cannot start (no driver or library: says which); "
              "info with `--demo`"),
    AlertRule("GpuLost", "critical", "`NVML_ERROR_GPU_IS_LOST`: the GPU fell off the bus",
              prometheus_rule=False),  # a lost GPU shows as NVML errors: only the daemon sees it
))
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
        self.gpus: dict[int, GpuReading] = {}
        self.reader: NvmlReader | None = None
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
            g = self.gpus[idx].as_json()
            h = self.history.get(idx, {})
            g["history"] = {k: list(v) for k, v in h.items()}
            gpus.append(g)
        return {"nvml": {"ok": self.session.ok, "error": self.session.error,
                         "driver_version": self.session.driver_version}, "gpus": gpus}

    def collect(self):
        """The GPU series of /metrics, from the last poll: `gpu` and `uuid` labels, never a pid."""
        fam = {name: kind(name, doc, labels=["gpu", "uuid", *extra]) for name, (kind, doc, extra) in FAMILIES.items()}
        gauges = [(fam[name], key, scale) for name, _, key, scale in GPU_GAUGES + PARITY_GAUGES]
        for idx in sorted(self.gpus):
            g = self.gpus[idx]
            lv = [str(idx), g.uuid]
            for family, key, scale in gauges:
                if getattr(g, key) is not None:
                    family.add_metric(lv, float(getattr(g, key)) * scale)
            active = set(g.clock_events_active)
            for reason in CLOCK_EVENT_REASONS.values():
                fam[CLOCK_EVENT_ACTIVE].add_metric(lv + [reason], 1.0 if reason in active else 0.0)
            if g.pcie_replays_total is not None:
                fam[PCIE_REPLAYS].add_metric(lv, float(g.pcie_replays_total))
            if g.energy_joules_total is not None:
                fam[ENERGY].add_metric(lv, g.energy_joules_total)
            if g.compute_mode is not None:
                fam[COMPUTE_MODE].add_metric(lv, float(g.compute_mode))
            rr = g.remapped_rows
            if rr is not None:
                fam[REMAPPED_ROWS].add_metric(lv + ["correctable"], float(rr.corrected))
                fam[REMAPPED_ROWS].add_metric(lv + ["uncorrectable"], float(rr.uncorrected))
                fam[REMAP_PENDING].add_metric(lv, float(rr.pending))
                fam[REMAP_FAILED].add_metric(lv, float(rr.failure))
            nv = g.nvlink
            if nv is not None:
                for direction, n in (("tx", nv.tx_bytes_total), ("rx", nv.rx_bytes_total)):
                    if n is not None:
                        fam[NVLINK_BYTES].add_metric(lv + [direction], float(n))
                for kind, n in nv.errors_total.items():
                    fam[NVLINK_ERRORS].add_metric(lv + [kind], float(n))
            if g.mig_enabled is not None:
                fam[MIG_ENABLED].add_metric(lv, float(g.mig_enabled))
            for m in g.mig_instances:
                ids = [str(m.gpu_instance), str(m.compute_instance)]
                if m.memory_used_bytes is not None:
                    fam[MIG_MEMORY_USED].add_metric(lv + ids, float(m.memory_used_bytes))
                    fam[MIG_MEMORY_TOTAL].add_metric(lv + ids, float(m.memory_total_bytes))
        yield from fam.values()
        yield GaugeMetricFamily(NVML_UP, "1 when NVML answers (0: no driver, library or GPU).",
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
        if self.reader is None or self.reader.N is not N:
            self.reader = NvmlReader(N)
        now = self.clock()
        g = self.reader.read(dev.index, dev.handle, uuid=dev.uuid, name=dev.name)
        if g.memory_used_bytes is None:  # the one read that must work: this poll fails for the GPU
            raise RuntimeError(f"GPU {dev.index}: NVML gives no memory info ({g.errors.get('memory')})")
        self.process_utilization[dev.index] = self.reader.process_utilization(dev.index, dev.handle)
        self.gpus[dev.index] = g
        hist = self.history.setdefault(dev.index, {k: collections.deque(maxlen=HISTORY)
                                                   for k in HISTORY_QUANTITIES})
        for k, dq in hist.items():
            dq.append(getattr(g, k))
        self._alerts(dev, g, now)

    def _alerts(self, dev, g: GpuReading, now: float) -> None:
        idx, labels = dev.index, {"gpu": dev.index, "uuid": dev.uuid}
        key = str(idx)
        # throttling that matters, held for throttle_for_s
        active = [r for r in g.clock_events_active if r in self.cfg.throttle_alert_reasons]
        for r in CLOCK_EVENT_REASONS.values():
            if r in active:
                self._throttle_since.setdefault((idx, r), now)
            else:
                self._throttle_since.pop((idx, r), None)
        held = [r for r in active if now - self._throttle_since[(idx, r)] >= self.cfg.throttle_for_s]
        if held:
            self.book.fire("GpuThrottled", key, severity="warning",
                           summary=f"GPU {idx} clocks held down: {', '.join(held)}",
                           description=f"SM clock {g.sm_clock_mhz} MHz, {g.temperature_celsius} °C, "
                                       f"{g.power_watts} W of {g.power_limit_watts} W",
                           labels={**labels, "reasons": ",".join(held)},
                           fix="; ".join(REASON_FIX.get(r, r) for r in held))
        else:
            self.book.resolve("GpuThrottled", key)
        # temperature
        t = g.temperature_celsius
        if t is not None and t >= self.cfg.temperature_max_celsius:
            self.book.fire("GpuHot", key, severity="warning",
                           summary=f"GPU {idx} at {t} °C (limit {self.cfg.temperature_max_celsius:.0f} °C)",
                           labels=labels, fix="check airflow, fans and inlet temperature")
        elif t is not None and t < self.cfg.temperature_max_celsius - 3:  # hysteresis
            self.book.resolve("GpuHot", key)
        # ECC and row remapping
        problems = []
        if g.ecc_volatile_uncorrected:
            problems.append(f"{g.ecc_volatile_uncorrected} volatile uncorrected ECC error(s)")
        rr = g.remapped_rows
        if rr and rr.pending:
            problems.append("a row remap is pending (applied at the next GPU reset)")
        if rr and rr.failure:
            problems.append("a row remap failed")
        if problems:
            self.book.fire("EccErrors", key, severity="critical",
                           summary=f"GPU {idx}: {'; '.join(problems)}", labels=labels,
                           fix="drain the GPU and reset it (nvidia-smi -r -i %d); a failed remap means RMA" % idx)
        else:
            self.book.resolve("EccErrors", key)
        # PCIe replays: any increase, held for counter_alert_hold_s
        r = g.pcie_replays_total
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
