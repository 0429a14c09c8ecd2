"""What a step costs, learned from the steps that ran, and the prefill chunk it allows.

A step's device time is close to `base(decodes) + per_token * prefill_tokens`: the decode
rows cost about the same whatever else runs (reading the weights, then each row's KV), and
prompt tokens cost about the same each (GEMMs at a size where the tensor cores are busy).
Both terms are measured, not configured: `base` as a moving average of decode-only steps
per batch-size bucket, `per_token` as a moving average of what mixed steps took beyond
their decode base. Until both are known the scheduler keeps the fixed token budget.

The chunk a step may take while streams decode (docs/design.md, "Scheduling"):
- enough to clear the prompt tokens waiting within `target_ttft` — prefill is never
  starved by decode, however many streams run;
- at most what keeps the step within `target_itl` — decode is never starved by prefill —
  but never below `min_chunk` tokens (the floor that guarantees prefill progress);
- at most `max_num_batched_tokens`.

The output poller calls `observe` (it is the one that knows a step's device time); the
step-loop thread calls `chunk_budget`. Floats written by one thread and read by the other:
a stale value costs one step's choice, never correctness.
"""

from __future__ import annotations

_ALPHA = 0.2          # moving-average weight of the newest step
_MIN_SAMPLES = 3      # per estimate, before it is trusted


def _bucket(decodes: int) -> int:
    """Decode batch sizes of similar cost: 0, 1, 2-3, 4-7, 8-15, ..."""
    return decodes.bit_length()


class StepCost:
    def __init__(self) -> None:
        self._base: dict[int, float] = {}       # bucket -> seconds of a decode-only step
        self._base_n: dict[int, int] = {}
        self.per_token: float | None = None     # seconds per prefill token (beyond base)
        self._per_token_n = 0

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if not seconds > 0:
            return
        if prefill_tokens == 0:
            b = _bucket(decodes)
            old = self._base.get(b)
            self._base[b] = seconds if old is None else old + _ALPHA * (seconds - old)
            self._base_n[b] = self._base_n.get(b, 0) + 1
            return
        if prefill_tokens < 64:     # too few tokens to say what one costs
            return
        base = self.decode_time(decodes) if decodes else 0.0
        if base is None:
            return
        per = max(seconds - base, 0.0) / prefill_tokens
        self.per_token = per if self.per_token is None else self.per_token + _ALPHA * (per - self.per_token)
        self._per_token_n += 1

    def decode_time(self, decodes: int) -> float | None:
        """Seconds of a decode-only step of this many rows, from the nearest measured bucket
        at or above it (a bigger batch costs at least as much), else the largest below."""
        b = _bucket(decodes)
        known = [k for k, n in self._base_n.items() if n >= _MIN_SAMPLES]
        if not known:
            return None
        above = [k for k in known if k >= b]
        return self._base[min(above)] if above else self._base[max(known)]

    def chunk_budget(self, decodes: int, backlog: int, *, cap: int, min_chunk: int,
                     target_itl: float, target_ttft: float) -> int:
        """Prompt tokens for the next step while `decodes` streams decode and `backlog`
        prompt tokens wait (admitted or not)."""
        base = self.decode_time(decodes)
        c = self.per_token
        if base is None or c is None or self._per_token_n < _MIN_SAMPLES or c <= 0:
            return cap
        itl_room = (target_itl - base) / c
        # steps of base + c*P seconds clear backlog tokens within target_ttft when
        # P * target_ttft / (base + c*P) >= backlog
        if target_ttft > c * backlog:
            ttft_need = backlog * base / (target_ttft - c * backlog)
        else:
            ttft_need = cap
        want = max(min_chunk, ttft_need)
        return int(min(cap, max(min_chunk, min(want, itl_room))))
