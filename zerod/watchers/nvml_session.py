"""One NVML session for the daemon's watchers.

NVML missing (no driver, no library) or failing to start is a state, not a
crash: `ensure()` retries every `retry_s` and says why it cannot. The module is
injectable (`nvml=`) so tests hand in a small fake pynvml.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from zerod.checks.gpu_reading import explain_init_error, text

log = logging.getLogger("zerod.nvml")


def _s(v: Any) -> str:
    return str(text(v))


@dataclass
class Device:
    index: int
    handle: Any
    uuid: str
    name: str
    bus_id: str | None
    memory_total_bytes: int | None


class NvmlSession:
    def __init__(self, nvml: Any = None, retry_s: float = 30.0) -> None:
        self._module = nvml
        self.retry_s = retry_s
        self.ok = False
        self.error: str | None = None
        self.driver_version: str | None = None
        self.devices: list[Device] = []
        self.lost: set[int] = set()
        self._tried_at: float | None = None
        self._lock = threading.Lock()
        self.generation = 0  # bumps on every successful init (handles change)

    @property
    def nvml(self) -> Any:
        if self._module is None:
            import pynvml  # nvidia-ml-py

            self._module = pynvml
        return self._module

    def ensure(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.ok:
                return True
            if self._tried_at is not None and now - self._tried_at < self.retry_s:
                return False
            self._tried_at = now
            try:
                N = self.nvml
                N.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded …
                self.error = _explain(exc)
                return False
            try:
                self.driver_version = _s(N.nvmlSystemGetDriverVersion())
            except Exception:
                self.driver_version = None
            devices = []
            try:
                count = N.nvmlDeviceGetCount()
                for i in range(count):
                    h = N.nvmlDeviceGetHandleByIndex(i)
                    devices.append(Device(i, h, _try(lambda: _s(N.nvmlDeviceGetUUID(h)), f"gpu{i}"),
                                          _try(lambda: _s(N.nvmlDeviceGetName(h)), "?"),
                                          _try(lambda: _s(N.nvmlDeviceGetPciInfo(h).busId), None),
                                          _try(lambda: int(N.nvmlDeviceGetMemoryInfo(h).total), None)))
            except Exception as exc:
                self.error = f"NVML started but listing GPUs failed: {_explain(exc)}"
                try:
                    N.nvmlShutdown()
                except Exception:
                    pass
                return False
            self.devices = devices
            self.lost = set()
            self.ok = True
            self.error = None
            self.generation += 1
            log.info("NVML %s: %d GPU(s), driver %s", "ready", len(devices), self.driver_version)
            return True

    def reset(self, why: str) -> None:
        """Drop the session (driver gone, GPU lost); `ensure` starts it again later."""
        with self._lock:
            if not self.ok:
                return
            self.ok = False
            self.error = why
            self._tried_at = time.monotonic()
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass

    def device(self, index: int) -> Device | None:
        for d in self.devices:
            if d.index == index:
                return d
        return None

    def close(self) -> None:
        self.reset("daemon stopping")


def _try(fn, default):
    try:
        return fn()
    except Exception:
        return default


def _explain(exc: BaseException) -> str:
    """Doctor's words for why NVML cannot start (zerod.checks.gpu_reading), else the error itself."""
    kind, why = explain_init_error(exc)
    return why if kind != "nvml_error" else f"{type(exc).__name__}: {exc}"
