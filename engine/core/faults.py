"""Fault injection: `ZEROD_FAULT` makes a healthy engine fail on purpose, so an
operator or a test can prove an alert path end to end (gpud's inject-fault).

    stall-after-steps:N     after N steps the step loop stops (it waits for
                            shutdown) while /health keeps answering 200:
                            EngineStalled's case
    corrupt-after-steps:N   after N steps the output head's rows are rotated by
                            one in place, so every greedy token changes with no
                            error anywhere: CanaryMismatch's case

Off unless set; a malformed value is refused (EngineError) before the model loads.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import torch

from ..config import EngineError

log = logging.getLogger("zerod.engine")

ENV = "ZEROD_FAULT"
KINDS = ("stall-after-steps", "corrupt-after-steps")
_SPEC = re.compile(r"([a-z-]+):(\d+)")


@dataclass(frozen=True)
class Fault:
    kind: str
    after_steps: int


def parse_fault(text: str) -> Fault:
    m = _SPEC.fullmatch(text.strip())
    if m is None or m.group(1) not in KINDS:
        raise EngineError(f"{ENV}={text!r}: must be one of {', '.join(k + ':N' for k in KINDS)} "
                          f"(N: the steps to run first, an integer >= 0)")
    return Fault(m.group(1), int(m.group(2)))


class FaultInjector:
    """Called by the step loop after each iteration; does its fault once the engine
    has run `after_steps` steps."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.done = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "FaultInjector | None":
        text = (os.environ if env is None else env).get(ENV, "")
        if not text:
            return None
        fault = parse_fault(text)
        log.warning("%s=%s: this engine fails on purpose after %d steps", ENV, text, fault.after_steps)
        return cls(fault)

    def after_step(self, engine) -> None:
        if self.done or engine._steps < self.fault.after_steps:
            return
        self.done = True
        if self.fault.kind == "stall-after-steps":
            log.warning("%s: the step loop stops after step %d at t=%.3f (until shutdown)", ENV, engine._steps,
                        time.time())
            engine._stop.wait()
        else:
            name = corrupt_weights(engine.model)
            log.warning("%s: %s perturbed after step %d at t=%.3f", ENV, name, engine._steps, time.time())


def corrupt_weights(model: torch.nn.Module) -> str:
    """Rotate the output head's rows by one, in place (CUDA graphs keep their
    pointers): each token's logit becomes its neighbour's, so argmax moves.
    Bytewise, so a quantized head is rotated the same way."""
    w = getattr(model.lm_head, "weight", None)
    name = "lm_head.weight"
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        name, w = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        raw = w.data.view(torch.uint8) if w.element_size() == 1 else w.data
        raw.copy_(raw.roll(1, 0))
    return name
