"""NVML reads that a GPU or driver may not support, each skipped for that GPU
from the first NOT_SUPPORTED on (logged once), never retried every second.

Besides the plain calls: field values (HBM temperature, NVLink throughput and
error counters, one nvmlDeviceGetFieldValues call for all of them),
per-process SM and memory utilization (nvmlDeviceGetProcessUtilization: the
samples since the last read), and MIG instances.
"""

from __future__ import annotations

import logging
from typing import Any

from zerod.watchers.nvml_session import error_value, is_gpu_lost, is_not_supported

log = logging.getLogger("zerod.nvml")

NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
ALL_LINKS = 0xFFFFFFFF  # scopeId: the sum over every NVLink
# key -> (NVML field id, scope id)
FIELDS = {
    "memory_temperature_celsius": (82, 0),  # NVML_FI_DEV_MEMORY_TEMP
    "nvlink_tx_kib": (138, ALL_LINKS),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
    "nvlink_rx_kib": (139, ALL_LINKS),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB
    "nvlink_crc_flit_errors": (38, 0),  # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
    "nvlink_crc_data_errors": (45, 0),  # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    "nvlink_replay_errors": (52, 0),  # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    "nvlink_recovery_errors": (59, 0),  # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
}
# nvmlValueType_t -> the member of the value union
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlReads:
    def __init__(self, nvml: Any) -> None:
        self.N = nvml
        self.unsupported: dict[int, set[str]] = {}  # GPU index -> calls/fields skipped from now on
        self._util_since: dict[int, int] = {}  # GPU index -> last process-utilization timestamp (us)

    def _skip(self, gpu: int, what: str, why: str) -> None:
        self.unsupported.setdefault(gpu, set()).add(what)
        log.info("GPU %d: %s %s; not read again", gpu, what, why)

    def call(self, gpu: int, name: str, handle: Any, *args: Any) -> Any:
        """N.<name>(handle, *args), or None: unsupported (skipped from now on) or
        failing this time. A lost GPU raises: the caller decides."""
        what = name if not args else f"{name}{args}"
        if what in self.unsupported.get(gpu, ()):
            return None
        fn = getattr(self.N, name, None)
        if fn is None:
            self._skip(gpu, what, "is not in these NVML bindings")
            return None
        try:
            return fn(handle, *args)
        except Exception as exc:
            if is_gpu_lost(exc):
                raise
            if is_not_supported(exc) or error_value(exc) == NVML_ERROR_FUNCTION_NOT_FOUND:
                self._skip(gpu, what, "is not supported by this GPU or driver")
            return None

    def fields(self, gpu: int, handle: Any) -> dict[str, float]:
        """The FIELDS this GPU supports, read in one call."""
        skipped = self.unsupported.get(gpu, set())
        keys = [k for k in FIELDS if f"field {k}" not in skipped]
        if not keys or "nvmlDeviceGetFieldValues" in skipped:
            return {}
        values = self.call(gpu, "nvmlDeviceGetFieldValues", handle, [FIELDS[k] for k in keys])
        out: dict[str, float] = {}
        for key, fv in zip(keys, values or []):
            ret = getattr(fv, "nvmlReturn", 0)
            if ret == 0:
                out[key] = float(getattr(fv.value, _VALUE_MEMBER.get(getattr(fv, "valueType", 3), "ullVal")))
            elif ret in (3, NVML_ERROR_FUNCTION_NOT_FOUND):  # not supported: no NVLink, no HBM sensor
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
            if is_gpu_lost(exc):
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

    def mig(self, gpu: int, handle: Any) -> tuple[bool | None, list[dict[str, Any]]]:
        """(MIG enabled, or None when the GPU has no MIG; its instances)."""
        mode = self.call(gpu, "nvmlDeviceGetMigMode", handle)
        if mode is None:
            return None, []
        if mode[0] != 1:
            return False, []
        out = []
        for i in range(self.call(gpu, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            try:
                mh = self.N.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except Exception as exc:
                if is_gpu_lost(exc):
                    raise
                continue  # NOT_FOUND: an empty slot
            mem = self.call(gpu, "nvmlDeviceGetMemoryInfo", mh)
            uuid = self.call(gpu, "nvmlDeviceGetUUID", mh)
            out.append({"uuid": _s(uuid) if uuid is not None else None,
                        "gpu_instance": self.call(gpu, "nvmlDeviceGetGpuInstanceId", mh),
                        "compute_instance": self.call(gpu, "nvmlDeviceGetComputeInstanceId", mh),
                        "memory_used_bytes": int(mem.used) if mem is not None else None,
                        "memory_total_bytes": int(mem.total) if mem is not None else None})
        return True, out
