"""Where a step's launch time went, for the slow-launch log line.

A launch is host work: staging, then ~30 (decode graph) to ~1,000 (eager prefill) torch
ops and Triton launches, each of which lets go of the GIL. Its wall time splits into
- the step thread's own CPU time (Python, dispatch, a Triton compile, a host sync's spin),
- the garbage collector's pauses, in any thread (a collection holds the GIL), and
- the rest: the step thread waited, for the GIL held by another thread (the HTTP or
  poller thread), for the device (a blocking sync), or for a core (the OS).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass


class GcClock:
    """Seconds the process has spent in garbage collection since it was made: in all
    (a collection holds the GIL, so it stalls the step thread whichever thread runs it)
    and per thread (one the step thread runs is already in its CPU time)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._by_thread: dict[int, float] = {}
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # collections do not nest and run under the GIL: one start time is enough
        if phase == "start":
            self._start = time.perf_counter()
        else:
            took = time.perf_counter() - self._start
            self.total += took
            me = threading.get_ident()
            self._by_thread[me] = self._by_thread.get(me, 0.0) + took

    def of_thread(self, ident: int) -> float:
        return self._by_thread.get(ident, 0.0)


GC_CLOCK = GcClock()   # one per process: the collector is the process's


@dataclass
class LaunchTimes:
    started: float = 0.0  # time.perf_counter() at its start
    wall: float = 0.0     # seconds, stage + launch
    stage: float = 0.0    # of which staging the inputs
    cpu: float = 0.0      # the step thread's CPU time
    gc: float = 0.0       # garbage collection, any thread
    gc_elsewhere: float = 0.0  # of which other threads ran (the step thread's is in cpu)

    @property
    def waited(self) -> float:
        """Wall time neither on this thread's CPU nor in another thread's collection: the
        GIL held by another thread, the device, or the OS running something else."""
        return max(self.wall - self.cpu - self.gc_elsewhere, 0.0)

    def describe(self) -> str:
        ms = 1000.0
        return (f"staging {self.stage * ms:.1f} ms, step thread on CPU {self.cpu * ms:.0f} ms, "
                f"garbage collection {self.gc * ms:.0f} ms, waiting (GIL, device or a core) {self.waited * ms:.0f} ms")


class LaunchClock:
    """Times one launch: start(), staged() after staging, elapsed() at the end, and
    done() for the breakdown of a slow one."""

    __slots__ = ("_t0", "_c0", "_g0", "_g0_here", "_staged")

    def start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), time.thread_time()
        self._g0, self._g0_here = GC_CLOCK.total, GC_CLOCK.of_thread(threading.get_ident())
        self._staged = self._t0

    def staged(self) -> None:
        self._staged = time.perf_counter()

    @property
    def started(self) -> float:
        return self._t0

    def elapsed(self) -> float:
        """Wall seconds since start() (cheap: the check every step makes)."""
        return time.perf_counter() - self._t0

    def done(self) -> LaunchTimes:
        wall = time.perf_counter() - self._t0
        gc_all = GC_CLOCK.total - self._g0
        gc_here = GC_CLOCK.of_thread(threading.get_ident()) - self._g0_here
        return LaunchTimes(started=self._t0, wall=wall, stage=self._staged - self._t0,
                           cpu=time.thread_time() - self._c0, gc=gc_all, gc_elsewhere=gc_all - gc_here)
