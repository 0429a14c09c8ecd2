"""Standalone mode: what `zerod top` shows with no daemon to ask. It reads NVML and
/proc itself and returns the same `Snapshot` the control API would give: GPUs (with
a history of this session), GPU processes (tagged as doctor tags them, with host
CPU %, RSS and parents), and doctor's last report from disk. No engine figures and
no alerts: those live in the daemon.

The one module of the dashboard that reads the host: every NVML, /proc and doctor
import of the TUI is here. GPUs are read through the shared GPU layer
(checks/gpu_reading.py), the processes through doctor's scan, so a GPU row and a
process row mean what they mean in `zerod doctor` and the daemon.
"""

from __future__ import annotations

import collections
import socket
import time
from typing import Any, Callable

import psutil

import zerod.checks.gpu_processes as gp
import zerod.checks.last_report as last_report
from zerod import __version__
from zerod.checks.gpu_reading import NvmlReader, explain_init_error, text
from zerod.tui.client import Snapshot

HISTORY = 600  # samples per series, as the daemon's /v1/gpus history
# the fd scan reads every fd of every process: a full scan at most this often (NVML's
# process lists are in it too); CPU, RSS and SM figures are read at every poll
SCAN_EVERY_S = 5.0
HISTORY_KEYS = ("utilization_ratio", "memory_used_bytes", "temperature_celsius", "power_watts")
_nvml_module: Any = None


class NvmlUnavailable(Exception):
    """NVML cannot start here; the message says why, in doctor's words."""


def nvml_session() -> Any:
    """The initialised pynvml module, or NvmlUnavailable. A failure is not kept: the
    next poll tries again (a driver loaded meanwhile is found)."""
    global _nvml_module
    if _nvml_module is None:
        try:
            import pynvml as N

            N.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(explain_init_error(exc)[1]) from None
        _nvml_module = N
    return _nvml_module


ROLE = {"self": "engine", "engine": "engine", "system": "allowed", "allowed": "allowed",
        "agent": "foreign", "foreign": "foreign"}


class LocalSource:
    def __init__(self, *, nvml: Callable[[], Any] = nvml_session, scan: Callable[..., list] = gp.scan_gpu_processes,
                 load_report: Callable[[], dict | None] = last_report.load,
                 host: str | None = None, allowed: tuple[str, ...] = (), scan_every_s: float = SCAN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml
        self._scan = scan
        self._load_report = load_report
        self.host = host or socket.gethostname()
        self.allowed = allowed
        self.history: dict[int, dict[str, collections.deque]] = {}
        self._reader: NvmlReader | None = None
        self._psutil: dict[int, psutil.Process] = {}
        self.scan_every_s = scan_every_s
        self._clock = clock
        self._scanned: tuple[float, bool, list] | None = None  # (when, with NVML, the processes)
        self.scans = 0

    # ---------------------------------------------------------------- GPUs
    def gpus(self) -> tuple[dict[str, Any], dict[int, dict[int, float]]]:
        """(the /v1/gpus document, {gpu: {pid: SM ratio}}), read through the shared
        GPU layer (checks/gpu_reading.py) as doctor and the daemon read them."""
        try:
            N = self._nvml()
        except NvmlUnavailable as exc:
            return {"nvml": {"ok": False, "error": str(exc), "driver_version": None}, "gpus": []}, {}
        if self._reader is None or self._reader.N is not N:
            self._reader = NvmlReader(N, lost_raises=False)
        try:
            driver = text(N.nvmlSystemGetDriverVersion())
            count = N.nvmlDeviceGetCount()
        except Exception as exc:
            return {"nvml": {"ok": False, "error": f"NVML: {exc}", "driver_version": None}, "gpus": []}, {}
        rows, sm = [], {}
        for i in range(count):
            try:
                h = N.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # a GPU NVML cannot open (lost): say so on its row
                rows.append({"index": i, "name": f"unreadable: {exc}", "clock_events_active": []})
                continue
            g = self._reader.read(i, h, parity=False).as_json()
            g["xid_events_total"] = {}  # XID events come from the daemon's event stream
            hist = self.history.setdefault(i, {k: collections.deque(maxlen=HISTORY) for k in HISTORY_KEYS})
            for k, dq in hist.items():
                dq.append(g.get(k))
            g["history"] = {k: list(v) for k, v in hist.items()}
            rows.append(g)
            sm[i] = {pid: ratios[0] for pid, ratios in self._reader.process_utilization(i, h).items()}
        return {"nvml": {"ok": True, "error": None, "driver_version": driver}, "gpus": rows}, sm

    # ---------------------------------------------------------------- processes
    def processes(self, nvml_ok: bool, sm: dict[int, dict[int, float]]) -> dict[str, Any]:
        rows = []
        t = self._clock()
        if self._scanned is None or self._scanned[1] != nvml_ok or t - self._scanned[0] >= self.scan_every_s:
            self._scanned = (t, nvml_ok, self._scan(nvml=nvml_ok))
            self.scans += 1
        for p in self._scanned[2]:
            role, why = gp.classify(p, (), self.allowed)
            agent = gp.match_agent(p) if ROLE.get(role) == "foreign" else None
            gpu = p.gpus[0] if p.gpus else None
            rows.append({
                "pid": p.pid, "gpu": gpu, "name": p.name, "cmdline": p.cmdline, "user": p.user,
                "unit": p.unit, "container": p.container, "gpu_memory_bytes": p.gpu_memory_bytes,
                "role": ROLE.get(role, "foreign"), "why": why, "known_agent": agent,
                "fix": gp.KNOWN_AGENTS[agent].fix if agent else None, "first_seen": None, "engines": [],
                "sm_utilization_ratio": sm.get(gpu, {}).get(p.pid) if gpu is not None else None,
                "memory_utilization_ratio": None, **self._host(p.pid, p.ppid)})
        gone = set(self._psutil) - {r["pid"] for r in rows}
        for pid in gone:
            del self._psutil[pid]
        return {"processes": rows}

    def _host(self, pid: int, ppid: int | None) -> dict[str, Any]:
        out = {"cpu_percent": None, "rss_bytes": None, "started_at": None, "ppid": ppid, "parent_name": None}
        try:
            new = pid not in self._psutil
            proc = self._psutil.setdefault(pid, psutil.Process(pid)) if new else self._psutil[pid]
            with proc.oneshot():
                cpu = proc.cpu_percent(None)
                out.update(cpu_percent=None if new else cpu, rss_bytes=int(proc.memory_info().rss),
                           started_at=proc.create_time())
            if ppid:
                out["parent_name"] = psutil.Process(ppid).name()
        except (psutil.Error, OSError):
            self._psutil.pop(pid, None)
        return out

    # ---------------------------------------------------------------- all
    def snapshot(self, now: float | None = None) -> Snapshot:
        now = time.time() if now is None else now
        gpus, sm = self.gpus()
        procs = self.processes(bool(gpus["nvml"]["ok"]), sm)
        report = self._load_report() or {}
        summary = report.get("summary") or {}
        status = {"version": __version__, "host": self.host, "standalone": True, "write_actions": False,
                  "engine": {}, "engines": [],
                  "preflight": ({**{k: summary.get(k) for k in ("pass", "warn", "fail", "skip", "error")},
                                 "exit_code": summary.get("exit_code"), "taken_at": report.get("taken_at")}
                                if summary else None)}
        return Snapshot(status=status, checks=report, gpus=gpus, processes=procs, alerts={"alerts": []},
                        engine={}, taken_at=now)
