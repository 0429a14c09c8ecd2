"""Probe the GPUs through NVML (the `pynvml` module of nvidia-ml-py).

NVML talks to the driver through /dev/nvidiactl: it never creates a CUDA context,
so doctor can run beside a busy engine. nvmlInit costs 60-80 ms once; every query
after it is well under a millisecond, so the session is kept for the process.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .facts import Facts
from .pci import normalize_bdf

_lock = threading.Lock()
_session: Any = None  # the pynvml module once nvmlInit succeeded
_init_error: dict | None = None

# NVML return codes that say *why* NVML is unusable.
_WHY = {
    9: ("no_driver", "no NVIDIA driver found: the nvidia kernel module is not loaded"),
    12: ("no_driver", "no NVIDIA driver found: libnvidia-ml.so.1 is not installed"),
    18: ("mismatch", "driver/library version mismatch: the loaded nvidia kernel module and "
                     "libnvidia-ml differ (a driver upgrade without a reboot)"),
    4: ("no_permission", "no permission to open the NVIDIA devices (/dev/nvidia*)"),
    17: ("gpu_lost", "a GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST)"),
}


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
            _init_error = {"kind": "no_pynvml", "error": f"nvidia-ml-py (pynvml) is not installed: {exc}"}
            raise NvmlUnavailable(_init_error) from None
        try:
            N.nvmlInit()
        except N.NVMLError as exc:
            kind, why = _WHY.get(getattr(exc, "value", None), ("nvml_error", f"nvmlInit failed: {exc}"))
            _init_error = {"kind": kind, "error": why, "nvml_error": str(exc)}
            raise NvmlUnavailable(_init_error) from None
        except OSError as exc:
            _init_error = {"kind": "no_driver", "error": f"no NVIDIA driver found: {exc}"}
            raise NvmlUnavailable(_init_error) from None
        _session = N
        return N


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


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
            system[key] = _s(getattr(N, fn)())
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


# nvmlValueType_t -> the member of nvmlValue_t that holds it
_VALUE_FIELD = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _recovery_action(N, h, d: dict[str, Any]) -> None:
    """What the driver says the GPU needs (nvidia-smi's "GPU Recovery Action"): a field
    value from R550 drivers on, absent from older nvidia-ml-py and drivers."""
    fid = getattr(N, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if fid is None:
        d["errors"]["recovery_action"] = "this nvidia-ml-py has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
        return
    try:
        (v,) = N.nvmlDeviceGetFieldValues(h, [fid])
    except N.NVMLError as exc:
        d["errors"]["recovery_action"] = str(exc)
        return
    if v.nvmlReturn != 0:
        d["errors"]["recovery_action"] = str(N.NVMLError(v.nvmlReturn))
        return
    d["recovery_action"] = int(getattr(v.value, _VALUE_FIELD.get(v.valueType, "uiVal")))


def _gpu(N, index: int) -> dict[str, Any]:
    d: dict[str, Any] = {"index": index, "errors": {}}
    try:
        h = N.nvmlDeviceGetHandleByIndex(index)
    except N.NVMLError as exc:
        d["errors"]["handle"] = str(exc)
        return d

    def get(key: str, fn: str, *args: Any, conv=lambda v: v) -> None:
        f = getattr(N, fn, None)
        if f is None:
            d["errors"][key] = f"{fn} is not in this nvidia-ml-py"
            return
        try:
            d[key] = conv(f(h, *args))
        except N.NVMLError as exc:
            d["errors"][key] = str(exc)

    get("name", "nvmlDeviceGetName", conv=_s)
    get("uuid", "nvmlDeviceGetUUID", conv=_s)
    get("minor", "nvmlDeviceGetMinorNumber")
    get("cc", "nvmlDeviceGetCudaComputeCapability", conv=list)
    get("bus_id", "nvmlDeviceGetPciInfo", conv=lambda p: normalize_bdf(p.busId))
    get("memory", "nvmlDeviceGetMemoryInfo",
        conv=lambda m: {"total": m.total, "free": m.free, "used": m.used})
    get("persistence", "nvmlDeviceGetPersistenceMode")
    get("mig", "nvmlDeviceGetMigMode", conv=list)
    get("ecc", "nvmlDeviceGetEccMode", conv=list)
    get("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration")
    get("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration")
    get("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth")
    get("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")
    get("pcie_replay", "nvmlDeviceGetPcieReplayCounter")
    get("pstate", "nvmlDeviceGetPerformanceState")
    get("util", "nvmlDeviceGetUtilizationRates", conv=lambda u: {"gpu": u.gpu, "memory": u.memory})
    fn = ("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(N, "nvmlDeviceGetCurrentClocksEventReasons")
          else "nvmlDeviceGetCurrentClocksThrottleReasons")
    get("clock_events", fn)
    get("remapped_rows", "nvmlDeviceGetRemappedRows",
        conv=lambda r: dict(zip(("correctable", "uncorrectable", "pending", "failure"), r)))
    get("retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
    get("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", 1, 0)  # UNCORRECTED, VOLATILE
    get("temperature_c", "nvmlDeviceGetTemperature", 0)
    get("power_w", "nvmlDeviceGetPowerUsage", conv=lambda mw: mw / 1000)
    get("compute_mode", "nvmlDeviceGetComputeMode")
    _recovery_action(N, h, d)
    get("vbios", "nvmlDeviceGetVbiosVersion", conv=_s)
    get("inforom_image", "nvmlDeviceGetInforomImageVersion", conv=_s)
    get("inforom_valid", "nvmlDeviceValidateInforom", conv=lambda _: True)  # raises Corrupted infoROM
    get("gsp_firmware", "nvmlDeviceGetGspFirmwareVersion", conv=_s)
    get("gsp_mode", "nvmlDeviceGetGspFirmwareMode", conv=list)  # [enabled, default]
    try:
        info = N.c_nvmlGpuFabricInfo_t()
        N.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
        d["fabric"] = {"state": info.state, "status": info.status}
    except (N.NVMLError, AttributeError, TypeError) as exc:
        d["errors"]["fabric"] = str(exc)
    return d
