"""Which per-row sampling features the requests in the scheduler use, counted at admission
and at the end (docs/perf.md "Host time per step"): a step skips each feature's per-row scan (penalty,
logit_bias, logprobs, prompt-logprob, grammar, min_p, min_tokens rows) when no request uses
it, and the sort of its rows by sample class when they all share one, so the plain path's
host time per step does not grow with the API's features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..sampling.penalties import uses_penalty

if TYPE_CHECKING:
    from .request import Request

FEATURES = ("penalty", "bias", "logprobs", "prompt_logprobs", "grammar", "min_p", "min_tokens")
CLASSES = 3   # sampler.row_class: 0 filtered random, 1 random, 2 greedy


@dataclass(frozen=True)
class Uses:
    """A step's view: True where some request in the scheduler uses the feature (its rows
    must be looked for); one_class: the sample class every request has, else None."""
    penalty: bool = True
    bias: bool = True
    logprobs: bool = True
    prompt_logprobs: bool = True
    grammar: bool = True
    min_p: bool = True
    min_tokens: bool = True
    one_class: int | None = None


ALL = Uses()   # nothing known: every scan runs (a Batch made by hand)


def features_of(r: Request) -> tuple[str, ...]:
    p = r.params
    used = (uses_penalty(p), bool(p.logit_bias), p.logprobs is not None,
            p.prompt_logprobs is not None, r.grammar is not None, p.min_p > 0.0,
            p.min_tokens > 0)
    return tuple(f for f, u in zip(FEATURES, used) if u)


class FeatureCounts:
    """Requests per feature and per sample class (the scheduler's, step thread only)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(FEATURES, 0)
        self.classes = [0] * CLASSES
        self._uses: Uses | None = None

    def add(self, r: Request) -> None:
        self._count(r, 1)

    def remove(self, r: Request) -> None:
        self._count(r, -1)

    def _count(self, r: Request, d: int) -> None:
        for f in features_of(r):
            self.counts[f] += d
        self.classes[r.sample_class] += d
        self._uses = None

    def uses(self) -> Uses:
        if self._uses is None:
            present = [c for c, n in enumerate(self.classes) if n]
            self._uses = Uses(**{f: n > 0 for f, n in self.counts.items()},
                              one_class=present[0] if len(present) == 1 else None)
        return self._uses
