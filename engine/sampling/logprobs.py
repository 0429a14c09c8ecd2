"""Log probabilities of sampled tokens and their top alternatives, on the device.

Values as vLLM gives them by default (its `logprobs_mode` "raw_logprobs"): the
log-softmax of the model's raw logits, before temperature, penalties, logit_bias, min_p,
top-k / top-p. So a token's logprob does not depend on how it was sampled, and the same
prompt gives the same values alone or batched.

Computed without a [rows, vocab] log-softmax: one logsumexp per row, then the top-k
logits and the sampled token's logit minus it. The step copies each row's
[sampled, top_1 .. top_k] values and the top-k ids into the host ring (output.HostRing)
next to the sampled ids; only rows that asked for logprobs are computed and copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM allows by default


@dataclass
class TokenLogprob:
    """One position: the chosen token's logprob and the top alternatives, best first.
    A prompt's first token has none (logprob and top None); prompt tokens carry their
    rank (prompt_logprobs.py)."""
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    rank: int | None = None


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [n, V] (raw), chosen int64 [n] -> (values float32 [n, 1 + k]:
    the chosen token's logprob then the top k; ids int64 [n, k])."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = logits.gather(1, chosen.unsqueeze(1))
    if k == 0:
        return picked - lse, torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    top_v, top_i = torch.topk(logits, k, dim=-1)
    return torch.cat([picked, top_v], dim=1) - lse, top_i


def rows_from_host(ids: list[int], vals: list[list[float]], top_ids: list[list[int]],
                   ks: list[int]) -> list[TokenLogprob]:
    """Host lists of one ring segment -> a TokenLogprob per row (ks: each row's own k)."""
    return [TokenLogprob(t, v[0], list(zip(ti[:k], v[1:1 + k])))
            for t, v, ti, k in zip(ids, vals, top_ids, ks)]
