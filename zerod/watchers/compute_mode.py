"""`[daemon] exclusive_gpu = true`: the engine's GPUs in EXCLUSIVE_PROCESS while it serves.

Once the engine is healthy, each GPU on which NVML lists the engine's process
(or a descendant) is switched to EXCLUSIVE_PROCESS through NVML: a second
process then cannot create a CUDA context there — a rogue job fails at its
start instead of doubling the engine's latency — while processes that only
read NVML (monitoring agents) keep working. Measured on the H200 as root: the
switch works while the engine serves and the engine keeps serving.

The mode each GPU had before is restored when that engine process ends — the
daemon stops, the engine crashes or hangs and is restarted — and set again
once the next engine process is healthy: a starting engine may need more than
one process on its GPU (a launcher, a profiling child), and a dead engine's
context is gone anyway. A GPU that already was EXCLUSIVE_PROCESS (`zerod
harden --exclusive-gpu`, or a daemon killed outright before it could restore)
is left so.

A refusal — no permission (setting the mode needs root), MIG enabled (the
compute mode is not the isolation there: MIG instances are), a GPU or driver
that does not support it — is logged once and raised as `ExclusiveGpuRefused`
(warning); the daemon and the engine go on as they were, and the next engine
process tries again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import psutil

from zerod.alerts import AlertBook
from zerod.checks.compute_mode import EXCLUSIVE_PROCESS, NO_PERMISSION
from zerod.checks.compute_mode import name as mode_name
from zerod.daemon_config import DaemonConfig
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher
from zerod.checks.gpu_reading import error_value, is_not_supported
from zerod.watchers.nvml_session import NvmlSession

log = logging.getLogger("zerod.compute_mode")


def descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


class Refused(Exception):
    pass


@owns(alerts=(AlertRule("ExclusiveGpuRefused", "warning", "with `exclusive_gpu`: the daemon cannot set "
                        "EXCLUSIVE_PROCESS on an engine's GPU, and says why"),))
class ComputeModeGuard(Watcher):
    name = "compute_mode"

    def __init__(self, session: NvmlSession, book: AlertBook, cfg: DaemonConfig, *,
                 engine_pid: Callable[[], int | None], engine_up: Callable[[], bool],
                 children: Callable[[int], set[int]] = descendants) -> None:
        super().__init__()
        self.session = session
        self.book = book
        self.cfg = cfg
        self.interval_s = cfg.watch_interval_s
        self.engine_pid = engine_pid
        self.engine_up = engine_up
        self.children = children
        self.held: dict[int, int] = {}  # GPU index -> its mode before
        self.refused: dict[int, str] = {}  # GPU index -> why
        self._engine: int | None = None  # the engine process the GPUs are held for
        self._lock = threading.Lock()

    def poll(self) -> None:
        with self._lock:
            pid = self.engine_pid()
            if pid != self._engine:
                self._restore_locked()
                self._engine = pid
            if pid is None or not self.engine_up() or not self.session.ensure():
                return
            pids = {pid} | self.children(pid)
            for dev in list(self.session.devices):
                if dev.index in self.held or dev.index in self.refused or not self._engine_holds(dev, pids):
                    continue
                try:
                    self._make_exclusive(dev)
                except Refused as exc:
                    self._refuse(dev, str(exc))

    def _engine_holds(self, dev, pids: set[int]) -> bool:
        try:
            return any(p.pid in pids for p in self.session.nvml.nvmlDeviceGetComputeRunningProcesses(dev.handle))
        except Exception:
            return False

    def _make_exclusive(self, dev) -> None:
        N, h = self.session.nvml, dev.handle
        try:
            if N.nvmlDeviceGetMigMode(h)[0] == 1:
                raise Refused("MIG is enabled on it: its GPU instances, not the compute mode, keep other "
                              "work off the engine's instance")
        except Refused:
            raise
        except Exception:
            pass  # no MIG on this GPU
        try:
            before = int(N.nvmlDeviceGetComputeMode(h))
            if before != EXCLUSIVE_PROCESS:
                N.nvmlDeviceSetComputeMode(h, EXCLUSIVE_PROCESS)
        except Exception as exc:
            raise Refused(_why(exc)) from None
        self.held[dev.index] = before
        if before == EXCLUSIVE_PROCESS:
            log.info("GPU %d (%s) already in Exclusive_Process: left so", dev.index, dev.uuid)
        else:
            log.info("GPU %d (%s): compute mode %s -> Exclusive_Process while the engine (pid %s) serves; "
                     "no other process can create a CUDA context there", dev.index, dev.uuid, mode_name(before),
                     self._engine)

    def _refuse(self, dev, why: str) -> None:
        self.refused[dev.index] = why
        log.warning("[daemon] exclusive_gpu: GPU %d (%s) stays as it is: %s", dev.index, dev.uuid, why)
        self.book.fire("ExclusiveGpuRefused", str(dev.index), severity="warning",
                       summary=f"GPU {dev.index}: cannot keep other processes off the engine's GPU: {why}",
                       description="[daemon] exclusive_gpu = true asks for EXCLUSIVE_PROCESS on the engine's GPUs; "
                                   "the engine serves on, but a second CUDA process can still start beside it "
                                   "(ForeignGpuProcess will say so)",
                       labels={"gpu": dev.index, "uuid": dev.uuid},
                       fix="run zerod as root for this (or `zerod harden --exclusive-gpu` once per boot), "
                           "or set [daemon] exclusive_gpu = false")

    def restore(self) -> None:
        """Give each held GPU its mode back (the daemon stops)."""
        with self._lock:
            self._restore_locked()
            self._engine = None

    def _restore_locked(self) -> None:
        N = self.session.nvml if self.session.ok else None
        for idx, before in sorted(self.held.items()):
            if before == EXCLUSIVE_PROCESS:
                continue
            dev = self.session.device(idx)
            try:
                if N is None or dev is None:
                    raise RuntimeError("NVML is not available")
                N.nvmlDeviceSetComputeMode(dev.handle, before)
                log.info("GPU %d: compute mode back to %s", idx, mode_name(before))
            except Exception as exc:
                log.error("GPU %d: could not restore compute mode %s (%s); `nvidia-smi -i %d -c %s` does it",
                          idx, mode_name(before), _why(exc), idx, mode_name(before).upper())
        self.held.clear()
        for idx in self.refused:
            self.book.resolve("ExclusiveGpuRefused", str(idx))
        self.refused.clear()

    def snapshot(self) -> dict[int, dict[str, Any]]:
        """{GPU index: {"exclusive_gpu": held by the daemon, "exclusive_refused": why or None}}."""
        out: dict[int, dict[str, Any]] = {}
        for idx in self.held:
            out.setdefault(idx, {})["exclusive_gpu"] = True
        for idx, why in self.refused.items():
            out.setdefault(idx, {})["exclusive_refused"] = why
        return out


def _why(exc: BaseException) -> str:
    v = error_value(exc)
    if v == NO_PERMISSION:
        return "NVML refused: no permission (setting the compute mode needs root)"
    if is_not_supported(exc):
        return "NVML refused: this GPU or driver does not support setting the compute mode"
    return f"NVML refused: {type(exc).__name__}: {exc}"
