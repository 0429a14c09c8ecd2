"""Processes holding /dev/nvidia* in uninterruptible sleep (state D) on two reads
`READ_GAP_S` apart: a process stuck inside the driver, usually after a GPU fault,
that no signal can end and that keeps the GPU from being reset. Reads the holders
the process scan found (fact `gpu.processes`); the gap is paid only when one is
in D on the first read."""

from __future__ import annotations

import time

from .facts import Facts, Roots

READ_GAP_S = 0.5


def _state(roots: Roots, pid: int) -> str | None:
    try:
        with open(roots.proc(f"{pid}/stat"), "rb") as f:
            text = f.read(4096).decode("utf-8", "replace")
        return text.rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None


def _wchan(roots: Roots, pid: int) -> str | None:
    try:
        with open(roots.proc(f"{pid}/wchan")) as f:
            return f.read(256).strip() or None
    except OSError:
        return None


def probe(facts: Facts, roots: Roots) -> None:
    procs = facts.value("gpu.processes")
    if procs is None:
        return  # the process scan failed: gpu.foreign_processes says why
    first = [p for p in procs if p.get("visible", True) and _state(roots, p["pid"]) == "D"]
    if first:
        time.sleep(READ_GAP_S)
    stuck = [{"pid": p["pid"], "name": p.get("name"), "devices": p.get("devices"), "gpus": p.get("gpus"),
              "wchan": _wchan(roots, p["pid"])}
             for p in first if _state(roots, p["pid"]) == "D"]
    facts.put("gpu.stuck_processes", {"read_gap_s": READ_GAP_S, "holders": len(procs), "stuck": stuck},
              roots.proc("PID/stat") + f" of each /dev/nvidia* holder, read twice {READ_GAP_S} s apart")
