"""A trace of every step: `ZEROD_STEP_TRACE=FILE` writes one JSON line a step, its shape
(prompt chunks and tokens, the chunks' attention pairs, decodes and their context, the
rows its forwards ran with their padding), the host time of its launch and the device
time of its forward, for diagnosing latency and for fitting gpu/schedule_sim.py's step
costs to a device.

The first line is a header (`"trace": "zerod-steps"`, the tuning, the page size and the
limits that size the graphs); then
one object a step, written by the output poller once the step's event has fired (never
by the step thread). Off unless set; the file is appended to, and tracing stops, with one
log line, after MAX_LINES steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import IO

from ..config import EngineError
from .scheduler import Batch

log = logging.getLogger("zerod.engine")

ENV = "ZEROD_STEP_TRACE"
MAX_LINES = 1_000_000      # ~150 MB: hours of steps, then the trace stops


def step_shape(batch: Batch, at: float, rows: tuple[int, int] | None = None) -> dict:
    """What a step ran, as the trace records it (the step thread computes it at launch,
    `at` its time.monotonic(); rows: the prefill and decode forwards' rows, padding
    included, 0 for a forward the step did not run; None leaves them out)."""
    return {"at": round(at, 6), "chunks": len(batch.chunks), "prompt_tokens": sum(c.n for c in batch.chunks),
            # the (query, key) pairs of the chunks' causal attention over their context
            "pairs": sum(c.n * c.start + c.n * (c.n + 1) // 2 for c in batch.chunks),
            "decodes": len(batch.decodes),
            "context": sum(r.prompt_len + r.num_scheduled for r in batch.decodes),
            **({"rows": list(rows)} if rows is not None else {})}


class StepTrace:
    def __init__(self, f: IO[str], header: dict) -> None:
        self._f = f
        self._lines = 0
        self._write(dict(trace="zerod-steps", **header))

    @classmethod
    def from_env(cls, header: dict, environ=None) -> "StepTrace | None":
        path = (environ if environ is not None else os.environ).get(ENV, "").strip()
        if not path:
            return None
        try:
            f = open(path, "a", encoding="utf-8", buffering=1 << 16)
        except OSError as exc:
            raise EngineError(f"{ENV}={path}: cannot open it for writing ({exc.strerror})") from None
        log.info("step trace: one line a step to %s", path)
        return cls(f, header)

    def step(self, shape: dict, launch_s: float, device_s: float) -> None:
        """One step's line (the poller's thread). A write that fails (a full disk) stops
        the trace, never the poller: the step's tokens still go out."""
        if self._f is None:
            return
        try:
            self._write({**shape, "launch_ms": round(launch_s * 1000, 3), "device_ms": round(device_s * 1000, 3)})
        except (OSError, ValueError) as exc:
            log.warning("step trace: writing failed (%s), tracing stops", exc)
            self._f = None
            return
        if self._lines >= MAX_LINES:
            log.warning("step trace: %d steps written, tracing stops", MAX_LINES)
            self.close()

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._lines += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def trace_header(tuning, cfg, model: str, max_model_len: int) -> dict:
    """What reads a trace needs to know of the engine: its tuning and the limits that size
    its graphs (gpu/schedule_sim.py pads the steps' rows as the runner does)."""
    return {"model": model, "page_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs, "max_model_len": max_model_len,
            "tuning": dataclasses.asdict(tuning)}
