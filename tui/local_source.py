"""Standalone mode: what `zerod top` shows with no daemon to ask. It reads NVML and
/proc itself and returns the same `Snapshot` the control API would give: GPUs (with
a history of this session), GPU processes (tagged as doctor tags them, with host
CPU %, RSS and parents), and doctor's last report from disk. No engine figures and
no alerts: those live in the daemon.

The one module of the dashboard that reads the host: every NVML, /proc and doctor
import of the TUI is here, so another GPU reading layer replaces this file alone.
"""

from __future__ import annotations

import collections
import socket
import time
from typing import Any, Callable

import psutil

from zerod import __version__
from zerod.checks import gpu_processes as gp
from zerod.checks import last_report
from zerod.checks.clock_events import reasons_from_mask
from zerod.checks.probe_nvml import NvmlUnavailable, session
from zerod.tui.client import Snapshot

HISTORY = 600  # samples per series, as the daemon's /v1/gpus history
ROLE = {"self": "engine", "engine": "engine", "system": "allowed", "allowed": "allowed",
        "agent": "foreign", "foreign": "foreign"}
START_HINT = "sudo systemctl start zerod   (or: zerod run --config /etc/zerod/zerod.toml)"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class LocalSource:
    def __init__(self, *, nvml: Callable[[], Any] = session, scan: Callable[..., list] = gp.scan_gpu_processes,
                 load_report: Callable[[], dict | None] = last_report.load,
                 host: str | None = None, allowed: tuple[str, ...] = ()) -> None:
        self._nvml = nvml
        self._scan = scan
        self._load_report = load_report
        self.host = host or socket.gethostname()
        self.allowed = allowed
        self.history: dict[int, dict[str, collections.deque]] = {}
        self._util_since: dict[int, int] = {}
        self._psutil: dict[int, psutil.Process] = {}

    # ---------------------------------------------------------------- GPUs
    def gpus(self) -> tuple[dict[str, Any], dict[int, dict[int, float]]]:
        """(the /v1/gpus document, {gpu: {pid: SM ratio}})."""
        try:
            N = self._nvml()
        except NvmlUnavailable as exc:
            return {"nvml": {"ok": False, "error": str(exc), "driver_version": None}, "gpus": []}, {}
        rows, sm = [], {}
        try:
            driver = _text(N.nvmlSystemGetDriverVersion())
            count = N.nvmlDeviceGetCount()
        except Exception as exc:
            return {"nvml": {"ok": False, "error": f"NVML: {exc}", "driver_version": None}, "gpus": []}, {}
        for i in range(count):
            try:
                g, util = self._gpu(N, i)
            except Exception as exc:  # a GPU NVML cannot read (lost): say so on its row
                g, util = {"index": i, "name": f"unreadable: {exc}", "clock_events_active": []}, {}
            rows.append(g)
            sm[i] = util
        return {"nvml": {"ok": True, "error": None, "driver_version": driver}, "gpus": rows}, sm

    def _gpu(self, N, i: int) -> tuple[dict[str, Any], dict[int, float]]:
        h = N.nvmlDeviceGetHandleByIndex(i)

        def opt(fn: str, *args: Any) -> Any:
            f = getattr(N, fn, None)
            try:
                return None if f is None else f(h, *args)
            except Exception:
                return None

        mem = N.nvmlDeviceGetMemoryInfo(h)
        util = opt("nvmlDeviceGetUtilizationRates")
        power, limit = opt("nvmlDeviceGetPowerUsage"), opt("nvmlDeviceGetEnforcedPowerLimit")
        mask = opt("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:
            mask = opt("nvmlDeviceGetCurrentClocksThrottleReasons")
        g = {"index": i, "uuid": _text(opt("nvmlDeviceGetUUID") or ""), "name": _text(opt("nvmlDeviceGetName") or "?"),
             "utilization_ratio": util.gpu / 100.0 if util is not None else None,
             "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total),
             "temperature_celsius": opt("nvmlDeviceGetTemperature", 0),
             "power_watts": power / 1000.0 if power is not None else None,
             "power_limit_watts": limit / 1000.0 if limit is not None else None,
             "sm_clock_mhz": opt("nvmlDeviceGetClockInfo", 1), "mem_clock_mhz": opt("nvmlDeviceGetClockInfo", 2),
             "clock_events_active": reasons_from_mask(int(mask)) if mask is not None else [],
             "pcie_replays_total": opt("nvmlDeviceGetPcieReplayCounter"),
             "ecc_volatile_uncorrected": opt("nvmlDeviceGetTotalEccErrors", 1, 0),
             "xid_events_total": {}}
        hist = self.history.setdefault(i, {k: collections.deque(maxlen=HISTORY) for k in (
            "utilization_ratio", "memory_used_bytes", "temperature_celsius", "power_watts")})
        for k, dq in hist.items():
            dq.append(g[k])
        g["history"] = {k: list(v) for k, v in hist.items()}
        samples = opt("nvmlDeviceGetProcessUtilization", self._util_since.get(i, 0)) or []
        latest: dict[int, Any] = {}
        for s in samples:
            if s.pid not in latest or s.timeStamp > latest[s.pid].timeStamp:
                latest[s.pid] = s
        if latest:
            self._util_since[i] = max(s.timeStamp for s in latest.values())
        return g, {pid: s.smUtil / 100.0 for pid, s in latest.items()}

    # ---------------------------------------------------------------- processes
    def processes(self, nvml_ok: bool, sm: dict[int, dict[int, float]]) -> dict[str, Any]:
        rows = []
        for p in self._scan(nvml=nvml_ok):
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
