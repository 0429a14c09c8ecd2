"""What a step costs, learned from the steps that ran, and the prompt chunk it allows.

A step's device time is close to `base(decodes) + fixed + per_token * prompt_tokens`
(the last two only when the step prefills): the decode rows cost about the same whatever
else runs, a prefill forward has a fixed cost (reading the weights once more, its
launches) and then a cost per token (GEMMs at a size that keeps the tensor cores busy).
All three are measured, not configured: `base` as a moving average of decode-only steps
per batch-size bucket; `fixed` and `per_token` as an exponentially weighted least-squares
line through what mixed steps took beyond their decode base. Until they are known the
scheduler keeps the fixed token budget.

The chunk a step may take while streams decode (docs/design.md, "Scheduling"):
- big enough that every waiting prompt gets its first token by its deadline: arrival +
  target_ttft + its own prefill time (a long prompt may take longer than a short one) —
  prefill is never starved by decode;
- at most what keeps the step within target_itl — decode is never starved by prefill —
  unless that is below `min_chunk` (the floor that guarantees prefill progress);
- at most `max_num_batched_tokens`.

The output poller calls `observe` (it knows a step's device time); the step-loop thread
calls `chunk_budget`. Floats written by one thread and read by the other: a stale value
costs one step's choice, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tuning import Tuning

_ALPHA = 0.2          # moving-average weight of the newest decode-only step
_DECAY = 0.97         # weight kept by older mixed steps in the line fit (~30 steps)
_MIN_SAMPLES = 3      # per estimate, before it is trusted
DEADLINES_CHECKED = 64    # prompts whose own deadlines size the chunk; the rest count as one


def _bucket(decodes: int) -> int:
    """Decode batch sizes of similar cost: 0, 1, 2-3, 4-7, 8-15, ..."""
    return decodes.bit_length()


@dataclass
class Pending:
    """A prompt still to prefill, as the budget sees it."""
    tokens: int          # prompt tokens not yet prefilled
    age: float           # seconds since it arrived
    prompt_len: int


class StepCost:
    def __init__(self, long_prompt_slack: float = Tuning.long_prompt_slack) -> None:
        self.slack = long_prompt_slack   # a prompt's deadline grows by this many times its prefill time
        self._base: dict[int, float] = {}       # bucket -> seconds of a decode-only step
        self._base_n: dict[int, int] = {}
        # exponentially weighted sums of (P, extra seconds) over mixed steps
        self._w = self._p = self._y = self._pp = self._py = 0.0
        self._line_n = 0

    # ------------------------------------------------------------------ learning
    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if not seconds > 0:
            return
        if prefill_tokens == 0:
            b = _bucket(decodes)
            old = self._base.get(b)
            self._base[b] = seconds if old is None else old + _ALPHA * (seconds - old)
            self._base_n[b] = self._base_n.get(b, 0) + 1
            return
        base = self.decode_time(decodes) if decodes else 0.0
        if base is None:
            return
        p, y = float(prefill_tokens), max(seconds - base, 0.0)
        d = _DECAY
        self._w = d * self._w + 1.0
        self._p = d * self._p + p
        self._y = d * self._y + y
        self._pp = d * self._pp + p * p
        self._py = d * self._py + p * y
        self._line_n += 1

    def prefill_line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a step's prefill, or None until known."""
        if self._line_n < _MIN_SAMPLES:
            return None
        w = self._w
        mp, my = self._p / w, self._y / w
        var = self._pp / w - mp * mp
        if var > (0.1 * mp) ** 2:                 # prompt sizes varied enough to fit a line
            per = (self._py / w - mp * my) / var
            if per > 0:
                return max(my - per * mp, 0.0), per
        return (0.0, my / mp) if mp > 0 and my > 0 else None

    def decode_time(self, decodes: int) -> float | None:
        """Seconds of a decode-only step of this many rows, from the nearest measured bucket
        at or above it (a bigger batch costs at least as much), else the largest below."""
        b = _bucket(decodes)
        known = [k for k, n in self._base_n.items() if n >= _MIN_SAMPLES]
        if not known:
            return None
        above = [k for k in known if k >= b]
        return self._base[min(above)] if above else self._base[max(known)]

    # ------------------------------------------------------------------ the budget
    def chunk_budget(self, decodes: int, pending: list[Pending], *, cap: int, min_chunk: int,
                     target_itl: float, target_ttft: float) -> int:
        """Prompt tokens for the next step while `decodes` streams decode; `pending` are the
        prompts still to prefill, in the order they will be served (the scheduler passes the
        first DEADLINES_CHECKED and the rest of the line as one)."""
        base = self.decode_time(decodes)
        line = self.prefill_line()
        if base is None or line is None:
            return cap
        fixed, c = line
        step0 = base + fixed                      # a step's cost before its first token
        need = 0.0
        cum = 0
        for p in pending:
            cum += p.tokens
            left = target_ttft + self.slack * c * p.prompt_len - p.age
            # steps of step0 + c*P seconds clear cum tokens in `left` seconds when
            # P * left / (step0 + c*P) >= cum
            if left <= c * cum:
                need = cap                        # already late: as fast as allowed
                break
            need = max(need, cum * step0 / (left - c * cum))
        itl_room = (target_itl - step0) / c
        return int(min(cap, max(min_chunk, min(max(need, min_chunk), itl_room))))
