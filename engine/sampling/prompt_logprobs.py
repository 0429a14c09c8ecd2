"""Prompt logprobs (completions' `echo` with `logprobs`, vLLM's `prompt_logprobs`): the
logprob of each prompt token given the tokens before it, its rank, and the top
alternatives, computed on the device in the prefill step that runs the token.

A prefill chunk covers prompt positions [start, start + n): its hidden row at position p
predicts prompt token p + 1, so the chunk gives tokens start + 1 .. start + n (the last one
is the next chunk's first). A chunk that completes the prompt gives one fewer: its last row
predicts the first output token, whose logprob the sampler's rows give. Position 0 has no
logprob (null, as in OpenAI and vLLM).

Only the chunks of requests that asked pay: their hidden rows go through the LM head in
pieces of PIECE_ROWS (one float [rows, vocab] block per piece bounds the memory), the values
(raw logits, as logprobs.py) are copied into the step's ring slot (output.HostRing's prompt
buffers) beside the sampled ids, non-blocking; the output poller gathers each request's
rows, and its first output carries them. No host sync.

A cached prefix has no hidden states: a request that asks for prompt logprobs takes no
prefix-cache hit (the scheduler gives it its own cache root; scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .logprobs import TokenLogprob, logprobs_of

if TYPE_CHECKING:
    from ..core.request import Request

PIECE_ROWS = 256   # prompt rows per LM-head call: 256 x vocab floats (128 MiB at 128K tokens)


@dataclass
class PromptSpan:
    """Rows [row0, row0 + count) of a step's prompt rows: prompt tokens first .. of req."""
    req: Request
    first: int
    count: int
    row0: int


@dataclass
class PromptRows:
    """A prefill step's prompt-logprob rows: token rows of the prefill's hidden states, the
    prompt token each predicts, and the most alternatives any of their requests asked for."""
    rows: torch.Tensor      # int64 [R]
    chosen: torch.Tensor    # int64 [R]
    k: int
    spans: list[PromptSpan]

    @property
    def count(self) -> int:
        return self.spans[-1].row0 + self.spans[-1].count


def stage(chunks, offsets, pack: Callable[[np.ndarray], torch.Tensor]) -> PromptRows | None:
    """The prompt rows of the chunks (prefill order; offsets[i]: chunk i's first token row)
    whose requests asked; None when none did or they have no row (a 1-token last chunk)."""
    spans, rows, chosen = [], [], []
    n_rows = 0
    for c, off in zip(chunks, offsets):
        r = c.req
        if r.params.prompt_logprobs is None:
            continue
        count = c.n - 1 if c.completes else c.n
        if count <= 0:
            continue
        spans.append(PromptSpan(r, c.start + 1, count, n_rows))
        rows.append(np.arange(off, off + count, dtype=np.int64))
        chosen.append(np.asarray(r.prompt_ids[c.start + 1:c.start + 1 + count], dtype=np.int64))
        n_rows += count
    if not spans:
        return None
    return PromptRows(pack(np.concatenate(rows)), pack(np.concatenate(chosen)),
                      max(s.req.params.prompt_logprobs for s in spans), spans)


def values_of(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n, k + 2]: the chosen token's logprob, the top k, and its rank (1 = the
    likeliest; exact as a float below 2^24); ids int64 [n, k]."""
    vals, ids = logprobs_of(logits, chosen, k)
    rank = (logits > logits.gather(1, chosen.unsqueeze(1))).sum(1, keepdim=True) + 1
    return torch.cat([vals, rank.float()], dim=1), ids


def compute(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            x: PromptRows, vals_out: torch.Tensor, ids_out: torch.Tensor) -> None:
    """Queue the rows' values into the host buffers (non-blocking copies, in pieces)."""
    k = x.k
    for a in range(0, x.count, PIECE_ROWS):
        b = min(a + PIECE_ROWS, x.count)
        logits = lm_head(hidden.index_select(0, x.rows[a:b])).float()
        vals, ids = values_of(logits, x.chosen[a:b], k)
        vals_out[a * (k + 2):b * (k + 2)].copy_(vals.reshape(-1), non_blocking=True)
        if k:
            ids_out[a * k:b * k].copy_(ids.reshape(-1), non_blocking=True)


def gather(x: PromptRows, vals_host: torch.Tensor, ids_host: torch.Tensor) -> None:
    """Poller side, after the step's event: append each span's rows to its request's
    `prompt_logprobs` list (started with position 0's null entry)."""
    k, n = x.k, x.count
    vals = vals_host[:n * (k + 2)].view(n, k + 2).tolist()
    ids = ids_host[:n * k].view(n, k).tolist() if k else [[]] * n
    for s in x.spans:
        r = s.req
        kr = r.params.prompt_logprobs
        if r.prompt_logprobs is None:
            r.prompt_logprobs = [TokenLogprob(r.prompt_ids[0], None, None)]
        for j in range(s.count):
            v, t = vals[s.row0 + j], ids[s.row0 + j]
            r.prompt_logprobs.append(TokenLogprob(r.prompt_ids[s.first + j], v[0],
                                                  list(zip(t[:kr], v[1:1 + kr])), int(v[-1])))
