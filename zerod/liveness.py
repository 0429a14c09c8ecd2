"""Is an engine that stopped answering `/health` slow or dead?

A failed probe alone does not say: an event loop busy encoding a large answer, a step
thread in a long prefill and a deadlocked or stopped process all time out alike. The
process itself does say: its scheduler state (stopped, zombie) and whether its threads
still use CPU. `Stall` records that evidence from the last good answer on, and tells the
supervisor which it is, with a sentence for the log and the alert.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

# CPU seconds the engine's processes must use between two failed probes to count as
# working (slow), not dead: a blocked process uses none; a busy loop, a whole core.
MIN_CPU_PROGRESS_S = 0.05
# Scheduler states of a process that cannot answer however long it is given.
NOT_RUNNING = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE,
               psutil.STATUS_DEAD)


@dataclass
class Sample:
    at: float
    status: str                 # psutil's status of the engine process ("gone" once it is)
    cpu_s: float                # user + system seconds of the process and its descendants
    threads: dict[str, float]   # CPU seconds by thread name (the names /health gave)


def sample(pid: int, thread_names: dict[int, str] | None = None) -> Sample:
    """The engine process `pid` now: its state, its CPU time and its named threads'."""
    now = time.monotonic()
    try:
        proc = psutil.Process(pid)
        status = proc.status()
        cpu = sum(proc.cpu_times()[:2])
        threads = {}
        names = thread_names or {}
        for t in proc.threads():
            if t.id in names:
                threads[names[t.id]] = t.user_time + t.system_time
        for child in proc.children(recursive=True):
            try:
                cpu += sum(child.cpu_times()[:2])
                for t in child.threads() if names else ():   # the engine's own process
                    if t.id in names:
                        threads[names[t.id]] = t.user_time + t.system_time
            except psutil.Error:
                pass
    except psutil.Error:
        return Sample(now, "gone", 0.0, {})
    return Sample(now, status, cpu, threads)


@dataclass
class Stall:
    """The failed probes since the engine's last good answer, and the process's state."""
    pid: int
    thread_names: dict[int, str] = field(default_factory=dict)
    failures: int = 0
    first: Sample | None = None
    last: Sample | None = None
    progressed: bool = False    # the last failure's interval saw CPU progress

    def failed(self) -> None:
        """One more failed probe: sample the process."""
        now = sample(self.pid, self.thread_names)
        prev = self.last
        self.failures += 1
        if self.first is None:
            self.first = now
        self.progressed = (now.status not in NOT_RUNNING and prev is not None
                           and now.cpu_s - prev.cpu_s >= MIN_CPU_PROGRESS_S)
        self.last = now

    @property
    def slow(self) -> bool:
        """Working but late: the process runs and used CPU since the previous failure."""
        return self.progressed

    def evidence(self) -> str:
        """What the process did during the stall, for the log and the alert."""
        first, last = self.first, self.last
        if first is None or last is None:
            return "no sample of the process"
        span = last.at - first.at
        parts = [f"process {self.pid} {last.status}",
                 f"{last.cpu_s - first.cpu_s:.2f} s CPU in {span:.1f} s"]
        moved = [f"{name} +{last.threads[name] - first.threads.get(name, 0.0):.2f} s"
                 for name in sorted(last.threads)]
        if moved:
            parts.append("threads: " + ", ".join(moved))
        verdict = "slow, not dead" if self.slow else "not progressing"
        return f"{verdict} ({'; '.join(parts)})"


def thread_names(health: dict) -> dict[int, str]:
    """tid -> thread name from a zerod serve /health answer's "threads", and its
    "engine_threads" when the engine runs in its own process ({} otherwise)."""
    if not isinstance(health, dict):
        return {}
    out: dict[int, str] = {}
    for key in ("threads", "engine_threads"):
        threads = health.get(key)
        if isinstance(threads, dict):
            out.update({tid: name for name, tid in threads.items()
                        if isinstance(name, str) and isinstance(tid, int)})
    return out
