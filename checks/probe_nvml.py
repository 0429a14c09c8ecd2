"""Probe the GPUs through NVML (the `pynvml` module of nvidia-ml-py).

NVML talks to the driver through /dev/nvidiactl: it never creates a CUDA context,
so doctor can run beside a busy engine. nvmlInit costs 60-80 ms once; every query
after it is well under a millisecond, so the session is kept for the process.
"""

from __future__ import annotations

import threading
from typing import Any

from .facts import Facts
from .gpu_reading import GpuInventory, GpuReading, NvmlReader, explain_init_error, text

_lock = threading.Lock()
_session: Any = None  # the pynvml module once nvmlInit succeeded
_init_error: dict | None = None


class NvmlUnavailable(Exception):
    def __init__(self, info: dict) -> None:
        super().__init__(info["error"])
        self.info = info


def session():
    """The initialised pynvml module, or NvmlUnavailable saying why not."""
    global _session, _init_error
    with _lock:
        if _session is not None:
            return _session
        if _init_error is not None:
            raise NvmlUnavailable(_init_error)
        try:
            import pynvml as N
        except ImportError as exc:
            kind, why = explain_init_error(exc)
            _init_error = {"kind": kind, "error": why}
            raise NvmlUnavailable(_init_error) from None
        try:
            N.nvmlInit()
        except N.NVMLError as exc:
            kind, why = explain_init_error(exc)
            _init_error = {"kind": kind, "error": why, "nvml_error": str(exc)}
            raise NvmlUnavailable(_init_error) from None
        except OSError as exc:
            kind, why = explain_init_error(exc)
            _init_error = {"kind": kind, "error": why}
            raise NvmlUnavailable(_init_error) from None
        _session = N
        return N


def probe(facts: Facts) -> None:
    try:
        N = session()
    except NvmlUnavailable as exc:
        facts.fail("nvml", exc.info["error"], "nvmlInit()")
        facts.put("nvml.status", {"ok": False, **exc.info}, "nvmlInit()")
        return
    system: dict[str, Any] = {}
    for key, fn in (("driver_version", "nvmlSystemGetDriverVersion"),
                    ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion_v2"),
                    ("nvml_version", "nvmlSystemGetNVMLVersion")):
        try:
            system[key] = text(getattr(N, fn)())
        except (N.NVMLError, AttributeError) as exc:
            system[key] = None
            system.setdefault("errors", {})[key] = str(exc)
    try:
        count = N.nvmlDeviceGetCount()
    except N.NVMLError as exc:
        facts.fail("nvml", f"nvmlDeviceGetCount failed: {exc}", "nvmlDeviceGetCount()")
        return
    system["count"] = count
    facts.put("nvml.status", {"ok": True}, "nvmlInit()")
    facts.put("nvml", system, "nvmlInit(), nvmlSystemGet*()")
    facts.put("nvml.gpus", [_gpu(N, i) for i in range(count)], "nvmlDeviceGet*()")


# doctor's facts keep their own keys (fixtures, check code and `zerod doctor --json`
# rely on them): the reading's quantity -> the fact key that holds it
_FACT_KEY = {
    "name": "name", "uuid": "uuid", "minor_number": "minor", "compute_capability": "cc", "bus_id": "bus_id",
    "memory": "memory", "persistence_mode": "persistence", "mig_mode": "mig", "ecc_mode": "ecc",
    "pcie_generation": "pcie_gen", "pcie_generation_max": "pcie_gen_max", "pcie_width_lanes": "pcie_width",
    "pcie_width_max_lanes": "pcie_width_max", "pcie_replays_total": "pcie_replay",
    "performance_state": "pstate", "utilization": "util", "clock_events": "clock_events",
    "remapped_rows": "remapped_rows", "retired_pages_pending": "retired_pending",
    "ecc_volatile_uncorrected": "ecc_uncorrected_volatile", "temperature_celsius": "temperature_c",
    "power_watts": "power_w", "compute_mode": "compute_mode", "recovery_action": "recovery_action",
    "vbios_version": "vbios", "inforom_image_version": "inforom_image", "inforom_valid": "inforom_valid",
    "gsp_firmware_version": "gsp_firmware", "gsp_firmware_mode": "gsp_mode", "fabric": "fabric",
}


def _percent(ratio: float) -> int:
    return int(round(ratio * 100))


def _facts_of(g: GpuReading, inv: GpuInventory) -> dict[str, Any]:
    """The reading in doctor's fact keys; a quantity NVML did not give is absent, its reason in errors."""
    rr = g.remapped_rows
    values = {
        "name": g.name, "uuid": g.uuid, "minor": inv.minor_number, "cc": inv.compute_capability,
        "bus_id": inv.bus_id,
        "memory": None if g.memory_total_bytes is None else {
            "total": g.memory_total_bytes, "free": g.memory_free_bytes, "used": g.memory_used_bytes},
        "persistence": inv.persistence_mode, "mig": g.mig_mode, "ecc": inv.ecc_mode,
        "pcie_gen": inv.pcie_generation, "pcie_gen_max": inv.pcie_generation_max,
        "pcie_width": inv.pcie_width_lanes, "pcie_width_max": inv.pcie_width_max_lanes,
        "pcie_replay": g.pcie_replays_total, "pstate": inv.performance_state,
        "util": None if g.utilization_ratio is None else {
            "gpu": _percent(g.utilization_ratio), "memory": _percent(g.memory_utilization_ratio)},
        "clock_events": g.clock_events_mask,
        "remapped_rows": None if rr is None else {"correctable": rr.corrected, "uncorrectable": rr.uncorrected,
                                                  "pending": rr.pending, "failure": rr.failure},
        "retired_pending": inv.retired_pages_pending, "ecc_uncorrected_volatile": g.ecc_volatile_uncorrected,
        "temperature_c": g.temperature_celsius, "power_w": g.power_watts, "compute_mode": g.compute_mode,
        "recovery_action": inv.recovery_action, "vbios": inv.vbios_version,
        "inforom_image": inv.inforom_image_version, "inforom_valid": inv.inforom_valid,
        "gsp_firmware": inv.gsp_firmware_version, "gsp_mode": inv.gsp_firmware_mode, "fabric": inv.fabric,
    }
    errors = {_FACT_KEY[k]: why for k, why in {**g.errors, **inv.errors}.items() if k in _FACT_KEY}
    return {**{k: v for k, v in values.items() if v is not None}, "errors": errors}


def _gpu(N, index: int) -> dict[str, Any]:
    try:
        h = N.nvmlDeviceGetHandleByIndex(index)
    except N.NVMLError as exc:
        return {"index": index, "errors": {"handle": str(exc)}}
    reader = NvmlReader(N, lost_raises=False)
    return {"index": index, **_facts_of(reader.read(index, h, parity=False), reader.inventory(index, h))}
