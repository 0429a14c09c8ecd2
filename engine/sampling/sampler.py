"""On-device sampling: greedy, temperature, min-p, top-k, top-p, per-request seed.

Random rows use the Gumbel-max trick with counter-based noise: the noise of vocabulary
entry v for a request is a hash of (seed, output index, v) computed with torch integer
ops. It depends on nothing else (not the batch, not the row, not a generator state), so a
seeded request gives the same tokens alone or in any batch, and the whole sampler is a
fixed sequence of tensor ops (batchable, no host sync, graph-capturable).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x446CA68B) & _M32   # multipliers < 2**31: products stay below 2**63
    x = x ^ (x >> 16)
    return x


_VHASH: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_hash(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    h = _VHASH.get(key)
    if h is None:
        v = torch.arange(vocab, device=device, dtype=torch.int64)
        h = _VHASH[key] = _mix32((v * 0x1E3779B1) & _M32)
    return h


def gumbel_noise(seeds: torch.Tensor, gen_idx: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Gumbel(0,1) noise from (seed, output index, token id)."""
    s = seeds.long()
    row = _mix32((_mix32(s & _M32) ^ ((s >> 32) & _M32)) & _M32)
    row = _mix32((row ^ _mix32(gen_idx.long() & _M32)) & _M32)          # [B]
    x = _mix32(row.unsqueeze(1) ^ _vocab_hash(vocab, seeds.device))      # [B, V], values < 2**32
    u = ((x >> 8).float() + 0.5) * (1.0 / 16777216.0)                    # (0, 1)
    return -torch.log(-torch.log(u))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask (with -inf) what min_p (0: off), top_k (<=0: off) and top_p (1: off) exclude;
    x [B, V] scaled logits. min_p applies first, to the whole distribution (as vLLM's)."""
    vocab = x.shape[1]
    srt, idx = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    if min_p is not None:
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p); log(0) = -inf drops nothing
        drop = drop | (srt < srt[:, :1] + torch.log(min_p).unsqueeze(1))
    srt = srt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs   # mass strictly above this entry
    drop = drop | (before > top_p.unsqueeze(1))
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, srt)


def row_class(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> int:
    """Rows are ordered by class before sampling: 0 random + min-p/top-k/top-p, 1 random,
    2 greedy."""
    if temperature <= 0.0 or top_k == 1:
        return 2
    return 0 if (top_k > 0 or top_p < 1.0 or min_p > 0.0) else 1


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, gen_idx: torch.Tensor, *,
           n_random: int, n_filter: int,
           suppress_ids: torch.Tensor | None = None,
           suppress_rows: torch.Tensor | None = None,
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, int64 [B]. logits float32 [B, V].

    Rows come ordered by row_class: the first n_filter rows need top-k/top-p, the first
    n_random rows are random (the rest greedy). These counts are host-known, so only the
    rows that need noise or a sort pay for it, with plain slices (no host sync).
    suppress_ids [S] are masked in rows where suppress_rows [B] is true (min_tokens).
    """
    if suppress_ids is not None and suppress_rows is not None:
        cols = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        cols[suppress_ids] = True
        logits = logits.masked_fill(suppress_rows.unsqueeze(1) & cols.unsqueeze(0), float("-inf"))
    if n_random == 0:
        return logits.argmax(dim=-1)
    x = logits[:n_random] / temperature[:n_random].unsqueeze(1)
    if n_filter:
        x = torch.cat([apply_top_k_top_p(x[:n_filter], top_k[:n_filter], top_p[:n_filter],
                                         None if min_p is None else min_p[:n_filter]),
                       x[n_filter:]])
    tok = (x + gumbel_noise(seeds[:n_random], gen_idx[:n_random], x.shape[1])).argmax(dim=-1)
    if n_random == logits.shape[0]:
        return tok
    return torch.cat([tok, logits[n_random:].argmax(dim=-1)])
