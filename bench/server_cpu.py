"""The server's CPU use over a measured window, read from /proc/PID (process and threads)."""

from __future__ import annotations

import os
import time
from typing import Any


def _stat_fields(path: str) -> list[bytes]:
    """A /proc stat file's fields after the command name (state, ppid, ...)."""
    with open(path, "rb") as f:
        s = f.read()
    return s[s.rfind(b")") + 2:].split()


def read_cpu(pid: int) -> tuple[float, dict[int, tuple[str, float]]] | None:
    """(process cpu seconds, {tid: (thread name, cpu seconds)}) from /proc, or None."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat_cpu(path: str) -> float:
        rest = _stat_fields(path)
        return (int(rest[11]) + int(rest[12])) / tick  # utime, stime

    try:
        total = stat_cpu(f"/proc/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return None
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            threads[int(tid)] = (name, stat_cpu(f"/proc/{pid}/task/{tid}/stat"))
        except (OSError, ValueError, IndexError):
            continue
    return total, threads


def _parent(pid: int) -> int | None:
    try:
        return int(_stat_fields(f"/proc/{pid}/stat")[1])
    except (OSError, ValueError, IndexError):
        return None


def serving_processes(pid: int, engine_pid: int | None) -> list[int]:
    """The processes that serve beside pid (the one whose /health answered): with the engine
    in a process of its own, the process that started it (the first HTTP server) and every
    child of that one: the engine and, with --api-server-count N, the other HTTP servers."""
    first = _parent(engine_pid) if engine_pid and engine_pid != pid else None
    if first is None:
        return [pid]
    kids = [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) == first]
    return [first] + sorted(kids)


def _read_all(pids: list[int]) -> tuple[float, dict[int, tuple[str, float]]] | None:
    """read_cpu summed over the serving processes (the first must be readable)."""
    reads = [read_cpu(p) for p in pids]
    if reads[0] is None:
        return None
    total, threads = 0.0, {}
    for r in reads:
        if r is not None:
            total += r[0]
            threads.update(r[1])
    return total, threads


class CpuWindow:
    """CPU the server used between start() and stop(), in cores; with engine_pid (an engine
    in its own process), the engine's and every HTTP server process's CPU counts too."""

    def __init__(self, pid: int | None, thread_names: dict[int, str] | None = None,
                 engine_pid: int | None = None) -> None:
        self.pid = pid
        self.engine_pid = engine_pid
        self.pids: list[int] = []
        self.thread_names = thread_names or {}  # tid -> name (the server's /health)
        self.t0 = 0.0
        self.c0: Any = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.pids = serving_processes(self.pid, self.engine_pid) if self.pid else []
        self.c0 = _read_all(self.pids) if self.pid else None

    def stop(self) -> dict[str, Any] | None:
        if not self.pid or self.c0 is None:
            return None
        c1 = _read_all(self.pids)
        wall = time.perf_counter() - self.t0
        if c1 is None or wall <= 0:
            return None
        by_name: dict[str, float] = {}
        for tid, (name, cpu) in c1[1].items():
            name = self.thread_names.get(tid, name)
            before = self.c0[1].get(tid, (name, 0.0))[1]
            by_name[name] = by_name.get(name, 0.0) + max(0.0, cpu - before)
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        return {"pid": self.pid, **({"engine_pid": self.engine_pid, "pids": self.pids}
                                    if len(self.pids) > 1 else {}),
                "wall_s": wall, "cpu_s": c1[0] - self.c0[0],
                "cores": (c1[0] - self.c0[0]) / wall,
                "threads_cores": {n: c / wall for n, c in top}}
