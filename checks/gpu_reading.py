"""One reading of a GPU through NVML: a typed snapshot with one name per quantity
and the unit in the name.

Doctor's NVML probe (zerod.checks.probe_nvml), the daemon's NVML watcher, its
metrics and `zerod top` read GPUs through this module, so a quantity has one name
and one conversion everywhere. It lives in checks/ because every room that reads
a GPU may import checks/ (docs/design.md), and it imports nothing but the standard
library: the NVML module is handed in (`pynvml`, or a test's fake).

`NvmlReader` owns the policy for calls a GPU or driver may not support: each is
skipped for that GPU from its first NOT_SUPPORTED on (logged once), a failing call
leaves its quantity None with the reason in `errors`, and a lost GPU raises
(`lost_raises=True`, the daemon) or is recorded like any failure (doctor).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from .clock_events import reasons_from_mask
from .compute_mode import name as compute_mode_name
from .pci import normalize_bdf

log = logging.getLogger("zerod.nvml")

# nvmlReturn_t values this layer and its callers act on (nvml.h)
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18

_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
_CLOCK_SM, _CLOCK_MEM = 1, 2  # nvmlClockType_t
_ECC_UNCORRECTED, _ECC_VOLATILE = 1, 0  # nvmlMemoryErrorType_t, nvmlEccCounterType_t
ALL_LINKS = 0xFFFFFFFF  # a field's scopeId: the sum over every NVLink
# field value -> (NVML field id, scope id): one nvmlDeviceGetFieldValues call reads them all
FIELDS = {
    "memory_temperature_celsius": (82, 0),  # NVML_FI_DEV_MEMORY_TEMP
    "nvlink_tx_kib": (138, ALL_LINKS),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    "nvlink_rx_kib": (139, ALL_LINKS),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    "nvlink_crc_flit_errors": (38, 0),  # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
    "nvlink_crc_data_errors": (45, 0),  # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    "nvlink_replay_errors": (52, 0),  # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    "nvlink_recovery_errors": (59, 0),  # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
}
NVLINK_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")
# nvmlValueType_t -> the member of the nvmlValue_t union that holds it
VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


# why NVML cannot start, by nvmlReturn_t: (kind, what the operator reads)
INIT_ERRORS = {
    NVML_ERROR_DRIVER_NOT_LOADED: ("no_driver", "no NVIDIA driver found: the nvidia kernel module is not loaded"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("no_driver", "no NVIDIA driver found: libnvidia-ml.so.1 is not installed"),
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: ("mismatch", "driver/library version mismatch: the loaded nvidia kernel "
                                         "module and libnvidia-ml differ (a driver upgrade without a reboot)"),
    NVML_ERROR_NO_PERMISSION: ("no_permission", "no permission to open the NVIDIA devices (/dev/nvidia*)"),
    NVML_ERROR_GPU_IS_LOST: ("gpu_lost", "a GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST)"),
}


def explain_init_error(exc: BaseException) -> tuple[str, str]:
    """(kind, why) for an exception of `import pynvml` or nvmlInit(); kind "nvml_error": not one we know."""
    if isinstance(exc, ImportError):
        return "no_pynvml", f"nvidia-ml-py (pynvml) is not installed: {exc}; pip install nvidia-ml-py"
    if error_value(exc) in INIT_ERRORS:
        return INIT_ERRORS[error_value(exc)]
    if isinstance(exc, OSError):
        return "no_driver", f"no NVIDIA driver found: {exc}"
    return "nvml_error", f"nvmlInit failed: {exc}"


def error_value(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def is_gpu_lost(exc: BaseException) -> bool:
    return error_value(exc) == NVML_ERROR_GPU_IS_LOST


def is_not_supported(exc: BaseException) -> bool:
    return error_value(exc) == NVML_ERROR_NOT_SUPPORTED


def _never_there(exc: BaseException) -> bool:
    """A call this GPU or driver will never answer: not supported, or not in the library."""
    return error_value(exc) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)


def text(v: Any) -> Any:
    """NVML strings: bytes from older nvidia-ml-py, str from newer."""
    return v.decode() if isinstance(v, bytes) else v


def field_value(fv: Any) -> float:
    return float(getattr(fv.value, VALUE_MEMBER.get(getattr(fv, "valueType", 3), "ullVal")))


@dataclass
class RemappedRows:
    corrected: int
    uncorrected: int
    pending: bool
    failure: bool


@dataclass
class NvlinkCounters:
    tx_bytes_total: int | None
    rx_bytes_total: int | None
    errors_total: dict[str, int]


@dataclass
class MigInstance:
    uuid: str | None
    gpu_instance: int | None
    compute_instance: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass
class GpuReading:
    """What a GPU reports now. None: the GPU or driver does not say (why: `errors`)."""

    index: int
    uuid: str | None = None
    name: str | None = None
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: int | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    clock_events_mask: int | None = None
    pcie_replays_total: int | None = None
    ecc_volatile_uncorrected: int | None = None
    remapped_rows: RemappedRows | None = None
    energy_joules_total: float | None = None
    compute_mode: int | None = None  # nvmlComputeMode_t
    mig_mode: list[int] | None = None  # [current, pending]; None: no MIG on this GPU
    nvlink: NvlinkCounters | None = None
    mig_instances: list[MigInstance] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # quantity -> why it is None

    @property
    def clock_events_active(self) -> list[str]:
        return reasons_from_mask(self.clock_events_mask) if self.clock_events_mask is not None else []

    @property
    def mig_enabled(self) -> bool | None:
        return None if self.mig_mode is None else self.mig_mode[0] == 1

    def as_json(self) -> dict[str, Any]:
        """The GPU row of the control API's /v1/gpus (docs/control-api.md)."""
        rr, nv = self.remapped_rows, self.nvlink
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "utilization_ratio": self.utilization_ratio,
            "memory_used_bytes": self.memory_used_bytes, "memory_total_bytes": self.memory_total_bytes,
            "temperature_celsius": self.temperature_celsius,
            "power_watts": self.power_watts, "power_limit_watts": self.power_limit_watts,
            "sm_clock_mhz": self.sm_clock_mhz, "mem_clock_mhz": self.mem_clock_mhz,
            "clock_events_active": self.clock_events_active,
            "pcie_replays_total": self.pcie_replays_total,
            "ecc_volatile_uncorrected": self.ecc_volatile_uncorrected,
            "remapped_rows": None if rr is None else {"corrected": rr.corrected, "uncorrected": rr.uncorrected,
                                                      "pending": rr.pending, "failure": rr.failure},
            "memory_temperature_celsius": self.memory_temperature_celsius,
            "energy_joules_total": self.energy_joules_total,
            "compute_mode": compute_mode_name(self.compute_mode) if self.compute_mode is not None else None,
            "nvlink": None if nv is None else {"tx_bytes_total": nv.tx_bytes_total,
                                               "rx_bytes_total": nv.rx_bytes_total,
                                               "errors_total": dict(nv.errors_total)},
            "mig_enabled": self.mig_enabled,
            "mig_instances": [vars(m).copy() for m in self.mig_instances],
        }


@dataclass
class GpuInventory:
    """What doctor reads once besides the reading: identity, link, modes, firmware."""

    minor_number: int | None = None
    compute_capability: list[int] | None = None
    bus_id: str | None = None
    persistence_mode: int | None = None
    ecc_mode: list[int] | None = None  # [current, pending]
    pcie_generation: int | None = None
    pcie_generation_max: int | None = None
    pcie_width_lanes: int | None = None
    pcie_width_max_lanes: int | None = None
    performance_state: int | None = None
    retired_pages_pending: int | None = None
    recovery_action: int | None = None  # nvmlDeviceGpuRecoveryAction_t, from R550 drivers on
    vbios_version: str | None = None
    inforom_image_version: str | None = None
    inforom_valid: bool | None = None
    gsp_firmware_version: str | None = None
    gsp_firmware_mode: list[int] | None = None  # [enabled, default]
    fabric: dict[str, int] | None = None  # {state, status}
    errors: dict[str, str] = field(default_factory=dict)


class NvmlReader:
    """Reads GPUs through one NVML module; keeps what each GPU does not support."""

    def __init__(self, nvml: Any, lost_raises: bool = True) -> None:
        self.N = nvml
        self.lost_raises = lost_raises
        self.unsupported: dict[int, set[str]] = {}  # GPU index -> calls and fields not tried again
        self._util_since: dict[int, int] = {}  # GPU index -> last process-utilization timestamp (us)

    def _skip(self, gpu: int, what: str, why: str) -> None:
        self.unsupported.setdefault(gpu, set()).add(what)
        log.info("GPU %d: %s %s; not read again", gpu, what, why)

    def call(self, gpu: int, fn_name: str, handle: Any, *args: Any,
             errors: dict[str, str] | None = None, key: str | None = None) -> Any:
        """N.<fn_name>(handle, *args), or None with the reason in errors[key]."""
        errors = {} if errors is None else errors
        key = key or fn_name
        what = fn_name if not args else f"{fn_name}{args}"
        if what in self.unsupported.get(gpu, ()):
            errors[key] = f"{fn_name} is not supported by this GPU or driver"
            return None
        fn = getattr(self.N, fn_name, None)
        if fn is None:
            self._skip(gpu, what, "is not in these NVML bindings")
            errors[key] = f"{fn_name} is not in this nvidia-ml-py"
            return None
        try:
            return fn(handle, *args)
        except Exception as exc:
            if is_gpu_lost(exc) and self.lost_raises:
                raise
            if _never_there(exc):
                self._skip(gpu, what, "is not supported by this GPU or driver")
            errors[key] = str(exc)
            return None

    def fields(self, gpu: int, handle: Any, keys: list[str] | None = None) -> dict[str, float]:
        """The FIELDS this GPU supports, read in one call."""
        skipped = self.unsupported.get(gpu, set())
        keys = [k for k in (keys or FIELDS) if f"field {k}" not in skipped]
        if not keys or "nvmlDeviceGetFieldValues" in skipped:
            return {}
        values = self.call(gpu, "nvmlDeviceGetFieldValues", handle, [FIELDS[k] for k in keys])
        out: dict[str, float] = {}
        for key, fv in zip(keys, values or []):
            ret = getattr(fv, "nvmlReturn", NVML_SUCCESS)
            if ret == NVML_SUCCESS:
                out[key] = field_value(fv)
            elif ret in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):  # no NVLink, no HBM sensor
                self._skip(gpu, f"field {key}", "is not supported by this GPU or driver")
        return out

    def process_utilization(self, gpu: int, handle: Any) -> dict[int, tuple[float, float]]:
        """{pid: (SM ratio, memory ratio)} from the samples since the last read."""
        what = "nvmlDeviceGetProcessUtilization"
        if what in self.unsupported.get(gpu, ()):
            return {}
        fn = getattr(self.N, what, None)
        if fn is None:
            self._skip(gpu, what, "is not in these NVML bindings")
            return {}
        try:
            samples = fn(handle, self._util_since.get(gpu, 0))
        except Exception as exc:
            if is_gpu_lost(exc) and self.lost_raises:
                raise
            if is_not_supported(exc):
                self._skip(gpu, what, "is not supported by this GPU or driver")
            # NOT_FOUND (or the bindings' error 0): no sample since the last read
            return {}
        latest: dict[int, Any] = {}
        for s in samples:
            if s.pid not in latest or s.timeStamp > latest[s.pid].timeStamp:
                latest[s.pid] = s
        if latest:
            self._util_since[gpu] = max(s.timeStamp for s in latest.values())
        return {pid: (s.smUtil / 100.0, s.memUtil / 100.0) for pid, s in latest.items()}

    def mig_instances(self, gpu: int, handle: Any) -> list[MigInstance]:
        out = []
        for i in range(self.call(gpu, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            try:
                mh = self.N.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except Exception as exc:
                if is_gpu_lost(exc) and self.lost_raises:
                    raise
                continue  # NOT_FOUND: an empty slot
            mem = self.call(gpu, "nvmlDeviceGetMemoryInfo", mh)
            uuid = self.call(gpu, "nvmlDeviceGetUUID", mh)
            out.append(MigInstance(uuid=str(text(uuid)) if uuid is not None else None,
                                   gpu_instance=self.call(gpu, "nvmlDeviceGetGpuInstanceId", mh),
                                   compute_instance=self.call(gpu, "nvmlDeviceGetComputeInstanceId", mh),
                                   memory_used_bytes=int(mem.used) if mem is not None else None,
                                   memory_total_bytes=int(mem.total) if mem is not None else None))
        return out

    def read(self, index: int, handle: Any, uuid: str | None = None, name: str | None = None,
             parity: bool = True) -> GpuReading:
        """The GPU's reading. `parity`: also what dcgm-exporter exports besides (HBM
        temperature, NVLink counters, MIG instances), which the daemon reads and doctor does not."""
        g = GpuReading(index=index, uuid=uuid, name=name)
        e = g.errors

        def get(key: str, fn_name: str, *args: Any, conv: Callable[[Any], Any] = lambda v: v) -> Any:
            v = self.call(index, fn_name, handle, *args, errors=e, key=key)
            return None if v is None else conv(v)

        if uuid is None:
            g.uuid = get("uuid", "nvmlDeviceGetUUID", conv=lambda v: str(text(v)))
        if name is None:
            g.name = get("name", "nvmlDeviceGetName", conv=lambda v: str(text(v)))
        util = get("utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            g.utilization_ratio, g.memory_utilization_ratio = util.gpu / 100.0, util.memory / 100.0
        mem = get("memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            g.memory_used_bytes, g.memory_total_bytes = int(mem.used), int(mem.total)
            g.memory_free_bytes = int(mem.free) if hasattr(mem, "free") else int(mem.total) - int(mem.used)
        g.temperature_celsius = get("temperature_celsius", "nvmlDeviceGetTemperature", _TEMPERATURE_GPU, conv=int)
        g.power_watts = get("power_watts", "nvmlDeviceGetPowerUsage", conv=lambda mw: mw / 1000.0)
        g.power_limit_watts = get("power_limit_watts", "nvmlDeviceGetEnforcedPowerLimit",
                                  conv=lambda mw: mw / 1000.0)
        g.sm_clock_mhz = get("sm_clock_mhz", "nvmlDeviceGetClockInfo", _CLOCK_SM)
        g.mem_clock_mhz = get("mem_clock_mhz", "nvmlDeviceGetClockInfo", _CLOCK_MEM)
        reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons"
                      if hasattr(self.N, "nvmlDeviceGetCurrentClocksEventReasons")
                      else "nvmlDeviceGetCurrentClocksThrottleReasons")
        g.clock_events_mask = get("clock_events", reasons_fn, conv=int)
        g.pcie_replays_total = get("pcie_replays_total", "nvmlDeviceGetPcieReplayCounter", conv=int)
        g.ecc_volatile_uncorrected = get("ecc_volatile_uncorrected", "nvmlDeviceGetTotalEccErrors",
                                         _ECC_UNCORRECTED, _ECC_VOLATILE, conv=int)
        g.remapped_rows = get("remapped_rows", "nvmlDeviceGetRemappedRows",
                              conv=lambda r: RemappedRows(int(r[0]), int(r[1]), bool(r[2]), bool(r[3])))
        g.energy_joules_total = get("energy_joules_total", "nvmlDeviceGetTotalEnergyConsumption",
                                    conv=lambda mj: mj / 1000.0)
        g.compute_mode = get("compute_mode", "nvmlDeviceGetComputeMode", conv=int)
        g.mig_mode = get("mig_mode", "nvmlDeviceGetMigMode", conv=list)
        if parity:
            self._parity(g, handle)
        return g

    def _parity(self, g: GpuReading, handle: Any) -> None:
        f = self.fields(g.index, handle)
        g.memory_temperature_celsius = f.get("memory_temperature_celsius")
        if any(k.startswith("nvlink_") for k in f):
            kib = {d: f.get(f"nvlink_{d}_kib") for d in ("tx", "rx")}
            g.nvlink = NvlinkCounters(
                tx_bytes_total=int(kib["tx"] * 1024) if kib["tx"] is not None else None,
                rx_bytes_total=int(kib["rx"] * 1024) if kib["rx"] is not None else None,
                errors_total={k: int(f[f"nvlink_{k}_errors"]) for k in NVLINK_ERRORS if f"nvlink_{k}_errors" in f})
        if g.mig_enabled:
            g.mig_instances = self.mig_instances(g.index, handle)

    def inventory(self, index: int, handle: Any) -> GpuInventory:
        inv = GpuInventory()
        e = inv.errors

        def get(key: str, fn_name: str, *args: Any, conv: Callable[[Any], Any] = lambda v: v) -> Any:
            v = self.call(index, fn_name, handle, *args, errors=e, key=key)
            return None if v is None else conv(v)

        inv.minor_number = get("minor_number", "nvmlDeviceGetMinorNumber")
        inv.compute_capability = get("compute_capability", "nvmlDeviceGetCudaComputeCapability", conv=list)
        inv.bus_id = get("bus_id", "nvmlDeviceGetPciInfo", conv=lambda p: normalize_bdf(p.busId))
        inv.persistence_mode = get("persistence_mode", "nvmlDeviceGetPersistenceMode")
        inv.ecc_mode = get("ecc_mode", "nvmlDeviceGetEccMode", conv=list)
        inv.pcie_generation = get("pcie_generation", "nvmlDeviceGetCurrPcieLinkGeneration")
        inv.pcie_generation_max = get("pcie_generation_max", "nvmlDeviceGetMaxPcieLinkGeneration")
        inv.pcie_width_lanes = get("pcie_width_lanes", "nvmlDeviceGetCurrPcieLinkWidth")
        inv.pcie_width_max_lanes = get("pcie_width_max_lanes", "nvmlDeviceGetMaxPcieLinkWidth")
        inv.performance_state = get("performance_state", "nvmlDeviceGetPerformanceState")
        inv.retired_pages_pending = get("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        self._recovery_action(index, handle, inv)
        inv.vbios_version = get("vbios_version", "nvmlDeviceGetVbiosVersion", conv=text)
        inv.inforom_image_version = get("inforom_image_version", "nvmlDeviceGetInforomImageVersion", conv=text)
        # nvmlDeviceValidateInforom returns nothing and raises on a corrupted infoROM
        self.call(index, "nvmlDeviceValidateInforom", handle, errors=e, key="inforom_valid")
        if "inforom_valid" not in e:
            inv.inforom_valid = True
        inv.gsp_firmware_version = get("gsp_firmware_version", "nvmlDeviceGetGspFirmwareVersion", conv=text)
        inv.gsp_firmware_mode = get("gsp_firmware_mode", "nvmlDeviceGetGspFirmwareMode", conv=list)
        try:
            info = self.N.c_nvmlGpuFabricInfo_t()
            self.N.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
            inv.fabric = {"state": info.state, "status": info.status}
        except Exception as exc:  # NVMLError, or bindings without the fabric struct
            if is_gpu_lost(exc) and self.lost_raises:
                raise
            e["fabric"] = str(exc)
        return inv

    def _recovery_action(self, index: int, handle: Any, inv: GpuInventory) -> None:
        """What the driver says the GPU needs (nvidia-smi's "GPU Recovery Action"): a field
        value from R550 drivers on, absent from older nvidia-ml-py and drivers."""
        fid = getattr(self.N, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if fid is None:
            inv.errors["recovery_action"] = "this nvidia-ml-py has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
            return
        values = self.call(index, "nvmlDeviceGetFieldValues", handle, [fid], errors=inv.errors,
                           key="recovery_action")
        if not values:
            return
        (v,) = values
        if v.nvmlReturn != NVML_SUCCESS:
            inv.errors["recovery_action"] = str(self.N.NVMLError(v.nvmlReturn))
            return
        inv.recovery_action = int(field_value(v))


def read_gpus(nvml: Any, reader: NvmlReader | None = None) -> list[GpuReading]:
    """Every GPU's reading, for a caller without a session of its own (a one-shot
    `zerod top`, a script): NVML must be initialised."""
    reader = reader or NvmlReader(nvml, lost_raises=False)
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception as exc:
            out.append(GpuReading(index=i, errors={"handle": str(exc)}))
            continue
        out.append(reader.read(i, h))
    return out
