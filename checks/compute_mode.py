"""GPU compute modes: their names, and reading and setting them through NVML.

EXCLUSIVE_PROCESS lets one process hold a CUDA context on the GPU: a second process
then fails to create its own, while processes that only read NVML (monitoring agents)
keep working. Measured on the device H200 as root: the switch works while the engine
serves, a second CUDA process is refused, and switching back to DEFAULT works.
The mode lasts until the driver unloads (a reboot, or a reset without persistence).
"""

from __future__ import annotations

from typing import Any

# nvmlComputeMode_t
DEFAULT, EXCLUSIVE_THREAD, PROHIBITED, EXCLUSIVE_PROCESS = 0, 1, 2, 3
NAMES = {DEFAULT: "Default", EXCLUSIVE_THREAD: "Exclusive_Thread", PROHIBITED: "Prohibited",
         EXCLUSIVE_PROCESS: "Exclusive_Process"}
NO_PERMISSION = 4  # NVML_ERROR_NO_PERMISSION


def name(mode: Any) -> str:
    return NAMES.get(mode, f"unknown mode {mode}")


class ComputeModeError(Exception):
    """NVML could not read or set a compute mode; `denied`: for lack of rights."""

    def __init__(self, message: str, denied: bool = False) -> None:
        super().__init__(message)
        self.denied = denied


class NvmlComputeModes:
    """The host's GPUs through NVML (the session doctor already keeps), by UUID:
    indexes can change between boots, a UUID does not."""

    def __init__(self, nvml=None) -> None:
        self._nvml = nvml

    @property
    def N(self):
        if self._nvml is None:
            from .probe_nvml import NvmlUnavailable, session

            try:
                self._nvml = session()
            except NvmlUnavailable as exc:
                raise ComputeModeError(f"cannot reach the GPUs: {exc}") from None
        return self._nvml

    def gpus(self) -> list[dict]:
        """[{index, uuid, mode}] for every GPU."""
        N = self.N
        out = []
        try:
            for i in range(N.nvmlDeviceGetCount()):
                h = N.nvmlDeviceGetHandleByIndex(i)
                uuid = N.nvmlDeviceGetUUID(h)
                out.append({"index": i, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                            "mode": N.nvmlDeviceGetComputeMode(h)})
        except N.NVMLError as exc:
            raise ComputeModeError(f"cannot read the compute mode: {exc}") from None
        return out

    def set(self, uuid: str, mode: int) -> None:
        N = self.N
        try:
            N.nvmlDeviceSetComputeMode(N.nvmlDeviceGetHandleByUUID(uuid), mode)
        except N.NVMLError as exc:
            denied = getattr(exc, "value", None) == NO_PERMISSION
            raise ComputeModeError(
                f"cannot set {uuid} to {name(mode)}: {exc}"
                + (" (setting the compute mode needs root)" if denied else ""), denied) from None
