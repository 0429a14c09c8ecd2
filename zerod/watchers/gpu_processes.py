"""Who holds the GPU, every second: NVML's process lists plus the /proc fd scan
(zerod.checks.gpu_processes, shared with doctor), each process classified as
the engine, the daemon, allowed, or foreign.

Cost: the full scan (readlink of every fd of every process) runs every
`full_scan_interval_s` and whenever a cheap check each tick sees a change: a
pid that was not there a tick ago and holds /dev/nvidia*, a pid in NVML's
process lists that is not known yet, a known holder gone. So a new process on
the GPU is seen within one tick; only a process that has run for a while and
then opens the GPU without a CUDA context (an nvmlInit alone) waits for the
next full scan.

A foreign process raises `ForeignGpuProcess` at the first scan that sees it
(<= `watch_interval_s` + one scan, so within 2 s), naming pid, command line,
user, systemd unit or container, the GPU memory it holds, and a known agent's
fix. Its severity follows the evidence, as doctor's `gpu.foreign_processes`
does: a CUDA context or GPU memory (it takes memory and SM time) is critical;
a process that only reads NVML is a warning — on the H200 an NVML-only agent
polling at 10 Hz and at ~94 Hz left the engine's ITL unchanged (docs/checks.md). Foreign processes seen in the last `cause_window_s` are kept for the
latency watcher, which names them as the likely cause of a regression.

With several engines ([[engines]]), a process is the engine of the engine whose
child it is, and a foreign process is attributed to the engines of the GPUs it
holds (all of them when it holds none in particular: /dev/nvidiactl alone):
its alert carries `engine`, and only those engines' latency watchers name it.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Callable

import psutil
from prometheus_client.core import GaugeMetricFamily

from zerod.alerts import AlertBook
from zerod.registry import AlertRule, owns
from zerod.daemon_config import DaemonConfig
from zerod.fleet import DEFAULT_NAME, EngineSpec
from zerod.watchers import Watcher

log = logging.getLogger("zerod.watchers.gpu_processes")


# the host figures of a process psutil cannot read (gone, or another user's under hidepid)
HOST_FIGURES_UNKNOWN = {"cpu_percent": None, "rss_bytes": None, "started_at": None, "ppid": None,
                        "parent_name": None}
YOUNG_S = 30.0  # a process this new is checked for /dev/nvidia* every tick


def _gp():
    from zerod.checks import gpu_processes

    return gpu_processes


def _gib(n: int | None) -> str:
    return "no GPU memory (fd scan only: an NVML/driver handle, no CUDA context)" if n is None \
        else f"{n / 2**30:.2f} GiB of GPU memory"


# doctor's verdict on a foreign process (zerod.checks.gpu_processes.foreign_severity), as an alert severity
SEVERITY = {"fail": "critical", "warn": "warning"}


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


FOREIGN_PROCESSES = "zerod_foreign_gpu_processes"
FOREIGN_MEMORY = "zerod_foreign_gpu_memory_bytes"


@owns(metrics=(FOREIGN_PROCESSES, FOREIGN_MEMORY),
      alerts=(AlertRule("ForeignGpuProcess", "critical", "a process that is not the engine, the daemon or an "
                        "allowed one holds a GPU: name, pid, command line, user, unit or container, GPU memory, "
                        "the known agent's fix"),))
class GpuProcessWatcher(Watcher):
    name = "gpu_processes"

    def __init__(self, book: AlertBook, cfg: DaemonConfig, *, allowed: tuple[str, ...] = (),
                 own_pids: Callable[[], set[int]], engine_pid: Callable[[], int | None] = lambda: None,
                 engines: Callable[[], list[tuple[EngineSpec, int | None]]] | None = None,
                 nvml_ok: Callable[[], bool] = lambda: True, roots: Any = None,
                 scan: Callable[..., list] | None = None, clock=time.time,
                 nvml_session: Any = None) -> None:
        super().__init__()
        self.book = book
        self.cfg = cfg
        self.interval_s = cfg.watch_interval_s
        self.allowed = tuple(allowed)
        self.own_pids = own_pids
        # (engine, its pid) for each engine; one untagged engine by default
        self.engines = engines or (lambda: [(EngineSpec(DEFAULT_NAME, (), {}), engine_pid())])
        self.nvml_ok = nvml_ok
        self.roots = roots
        self._scan = scan
        self.clock = clock
        self.nvml_session = nvml_session
        self.full_scan_interval_s = cfg.full_scan_interval_s
        self.procfs = getattr(roots, "procfs", None) or "/proc"
        self._known_pids: set[int] | None = None
        self._invisible: set[int] = set()  # NVML pids this /proc does not show
        self._born: dict[int, float] = {}  # pid -> when first listed (monotonic), while young
        self._last_full: float | None = None
        self.full_scans = 0
        self.quick_checks = 0
        self.last_full_reason: str | None = None
        self.rows: list[dict[str, Any]] = []
        # pid -> host CPU %, RSS, start time, parent: refreshed every tick, between full scans too
        self.host_figures: dict[int, dict[str, Any]] = {}
        self._psutil: dict[int, psutil.Process] = {}
        self.scan_stats: dict[str, Any] = {}
        self.first_seen: dict[int, float] = {}
        # pid -> its start time (psutil create_time) when first seen: a pid reused
        # by another process since then must not be signalled in its place
        self.start_times: dict[int, float | None] = {}
        # foreign processes seen lately (also those gone since): for LatencyRegression
        self.recent_foreign: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()

    def scan(self) -> list:
        fn = self._scan or _gp().scan_gpu_processes
        stats: dict[str, Any] = {}
        procs = fn(roots=self.roots, nvml=self.nvml_ok(), stats=stats)
        self.scan_stats = stats
        return procs

    # --- the cheap check between full scans
    def _pids(self) -> set[int]:
        try:
            return {int(p) for p in os.listdir(self.procfs) if p.isdigit()}
        except OSError:
            return set()

    def _holds_gpu(self, pid: int) -> bool:
        d = f"{self.procfs}/{pid}/fd"
        try:
            fds = os.listdir(d)
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"{d}/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
        return False

    def _nvml_pids(self) -> set[int] | None:
        s = self.nvml_session
        if s is None or not s.ok:
            return None
        N = s.nvml
        out: set[int] = set()
        for dev in s.devices:
            for fn in (N.nvmlDeviceGetComputeRunningProcesses, N.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    out.update(p.pid for p in fn(dev.handle))
                except Exception:
                    return None  # cannot tell: let the full scan decide
        return out

    def full_scan_reason(self, mono: float) -> str | None:
        """Why a full scan is due now, or None (nothing changed)."""
        pids = self._pids()
        known, self._known_pids = self._known_pids, pids
        # young processes (first listed < YOUNG_S ago) are looked at every tick:
        # a program opens the GPU some time after it starts (imports, CUDA init)
        if known is not None:  # at the first listing nothing is new
            for pid in pids - known:
                self._born[pid] = mono
        for pid in list(self._born):
            if pid not in pids or mono - self._born[pid] > YOUNG_S:
                del self._born[pid]
        if self._last_full is None or known is None:
            return "first scan"
        if self.full_scan_interval_s <= 0 or mono - self._last_full >= self.full_scan_interval_s:
            return "periodic"
        listed = {r["pid"] for r in self.rows}
        if listed - pids - self._invisible:
            return "a holder is gone"
        for pid in sorted(self._born):
            if pid not in listed and self._holds_gpu(pid):
                return f"new pid {pid} holds /dev/nvidia*"
        nv = self._nvml_pids()
        if nv is not None and nv - listed:
            return "NVML lists a new process"
        return None

    def poll(self) -> None:
        self._scan_if_due()
        self._refresh_host_figures()

    def _refresh_host_figures(self) -> None:
        """Host CPU %, RSS, start time and parent of each listed process, every tick
        (psutil keeps the CPU times between calls, so one Process object per pid)."""
        figures: dict[int, dict[str, Any]] = {}
        for row in self.rows:
            pid = row["pid"]
            proc = self._psutil.get(pid)
            try:
                new = proc is None
                if new:
                    proc = self._psutil[pid] = psutil.Process(pid)
                with proc.oneshot():
                    cpu = proc.cpu_percent(None)
                    cpu = None if new else cpu  # the first call only starts the measurement
                    rss = proc.memory_info().rss
                    ppid = proc.ppid()
                    started = proc.create_time()
                try:
                    parent = psutil.Process(ppid).name() if ppid else None
                except (psutil.Error, OSError):
                    parent = None
                figures[pid] = {"cpu_percent": cpu, "rss_bytes": int(rss), "started_at": started,
                                "ppid": ppid, "parent_name": parent}
            except (psutil.Error, OSError):
                self._psutil.pop(pid, None)
                figures[pid] = dict(HOST_FIGURES_UNKNOWN)
        for pid in list(self._psutil):
            if pid not in figures:
                del self._psutil[pid]
        self.host_figures = figures

    def _scan_if_due(self) -> None:
        mono = time.monotonic()
        reason = self.full_scan_reason(mono)
        self.quick_checks += 1
        if reason is None:
            return
        self.last_full_reason = reason
        self._last_full = mono
        self.full_scans += 1
        gp = _gp()
        procs = self.scan()
        self._invisible = {p.pid for p in procs if not getattr(p, "visible", True)}
        now = self.clock()
        own = set(self.own_pids())
        engines = self.engines()
        tagged = any(spec.tagged for spec, _ in engines)
        nvml_lists = self.nvml_ok()
        rows: list[dict[str, Any]] = []
        foreign: dict[str, dict[str, Any]] = {}
        seen: set[int] = set()
        for p in procs:
            seen.add(p.pid)
            # read at every full scan: a pid reused since the last one is another process,
            # whose own start time the signal action must compare against
            start = process_start_time(p.pid)
            before = self.start_times.get(p.pid)
            if before is not None and start is not None and abs(start - before) > 0.01:
                log.info("pid %d is another process than at the last scan (reused)", p.pid)
                self.first_seen.pop(p.pid, None)
            if start is not None or p.pid not in self.start_times:
                self.start_times[p.pid] = start
            first = self.first_seen.setdefault(p.pid, now)
            role, why = gp.classify(p, own, self.allowed)
            mine = [spec.name for spec, pid in engines if pid is not None and (p.pid == pid or pid in p.ancestors)]
            if role == "self":
                role = "engine" if mine else "daemon"
                why = "the engine started by this daemon" if mine else "this daemon (NVML handle)"
                if mine and tagged:
                    why = f"engine {mine[0]}, started by this daemon"
            elif role in ("system", "engine"):
                role = "allowed"
            elif role == "agent":
                role = "foreign"
            agent = gp.match_agent(p) if role == "foreign" else None
            fix = gp.KNOWN_AGENTS[agent].fix if agent else None
            gpu = p.gpus[0] if p.gpus else None
            if role == "foreign":  # the engines whose GPUs it holds (all: it holds none in particular)
                mine = [spec.name for spec, _ in engines if not p.gpus or set(p.gpus) & set(spec.gpus)] \
                    if tagged else []
                where = f"unit {p.unit}" if p.unit else (f"container {p.container}" if p.container else "no systemd unit")
                why = (f"{why}; " if why else "") + (
                    "holds GPU memory (NVML process list)" if p.source == "nvml"
                    else f"holds {', '.join(p.devices) or '/dev/nvidia*'} open (fd scan)")
                if not fix:
                    fix = (f"stop it ({'systemctl stop ' + p.unit if p.unit else 'kill ' + str(p.pid)}) "
                           f"or allow it in [doctor] allowed_gpu_processes")
                label = agent or p.name
                severity = SEVERITY[gp.foreign_severity(p, nvml_lists)]
                harm = ("a second process on the inference GPU steals memory and SM time and raises "
                        "the engine's tail latency") if severity == "critical" else (
                        "it holds no CUDA context and no GPU memory: an NVML reader, harmless to latency "
                        "at the polling rates measured, though profiling counters (DCGM's) can cost more")
                foreign[str(p.pid)] = dict(
                    severity=severity,
                    summary=f"{label} (pid {p.pid}) holds GPU {gpu if gpu is not None else '?'}"
                            + (f" (engine {', '.join(mine)})" if mine else ""),
                    description=(f"pid {p.pid} ({p.name}, user {p.user or '?'}, {where}) holds "
                                 f"{_gib(p.gpu_memory_bytes)} on GPU {','.join(map(str, p.gpus)) or '?'}; "
                                 f"command line: {p.cmdline or '?'}; "
                                 + (f"known agent: {gp.KNOWN_AGENTS[agent].description}; " if agent else "")
                                 + harm),
                    labels={"gpu": gpu, "process": label, "pid": p.pid, "unit": p.unit,
                            "container": p.container, "engine": ",".join(mine) or None},
                    fix=fix)
                self.recent_foreign[p.pid] = {"pid": p.pid, "name": label, "cmdline": p.cmdline,
                                              "unit": p.unit, "container": p.container, "gpu": gpu,
                                              "first_seen": first, "last_seen": now, "fix": fix,
                                              "holds_context": severity == "critical", "engines": mine}
                self.recent_foreign.move_to_end(p.pid)
            rows.append({
                "pid": p.pid, "gpu": gpu, "name": p.name, "cmdline": p.cmdline, "user": p.user,
                "unit": p.unit, "container": p.container, "gpu_memory_bytes": p.gpu_memory_bytes,
                "role": role, "why": why, "known_agent": agent, "fix": fix, "first_seen": first,
                "engines": mine if tagged else ([DEFAULT_NAME] if role == "engine" else []),
            })
        for pid in list(self.first_seen):
            if pid not in seen:
                del self.first_seen[pid]
                self.start_times.pop(pid, None)
        horizon = now - max(self.cfg.cause_window_s, 1.0)
        for pid, info in list(self.recent_foreign.items()):
            if info["last_seen"] < horizon:
                del self.recent_foreign[pid]
        role_order = {"engine": 0, "daemon": 1, "allowed": 2, "foreign": 3}
        rows.sort(key=lambda r: (role_order.get(r["role"], 9), r["pid"]))
        self.rows = rows
        self.book.sync("ForeignGpuProcess", foreign)

    def foreign(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["role"] == "foreign"]

    def foreign_start_time(self, pid: int) -> tuple[bool, float | None]:
        """(is `pid` a foreign process in the last scan, its start time then)."""
        return any(r["pid"] == pid for r in self.foreign()), self.start_times.get(pid)

    def snapshot(self) -> dict[str, Any]:
        return {"processes": [{**r, **self.host_figures.get(r["pid"], HOST_FIGURES_UNKNOWN)} for r in self.rows]}

    def collect(self):
        foreign = self.foreign()
        yield GaugeMetricFamily(FOREIGN_PROCESSES,
                                "Processes holding a GPU that are neither the engine nor allowed.",
                                value=float(len(foreign)))
        yield GaugeMetricFamily(FOREIGN_MEMORY, "GPU memory held by foreign processes.",
                                value=float(sum(r["gpu_memory_bytes"] or 0 for r in foreign)))

    def stats(self) -> dict:
        return {**super().stats(), "full_scans": self.full_scans, "quick_checks": self.quick_checks,
                "last_full_reason": self.last_full_reason, "scan": dict(self.scan_stats)}
