"""On-device sampling: greedy, temperature, top-k, top-p, per-request seed.

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


def gumbel_noise(seeds: torch.Tensor, gen_idx: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Gumbel(0,1) noise from (seed, output index, token id)."""
    s = seeds.long()
    row = _mix32((_mix32(s & _M32) ^ ((s >> 32) & _M32)) & _M32)
    row = _mix32((row ^ _mix32(gen_idx.long() & _M32)) & _M32)          # [B]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix32((row.unsqueeze(1) ^ ((v * 0x1E3779B1) & _M32)) & _M32)    # [B, V]
    x = _mix32(x)
    u = ((x >> 8).float() + 0.5) * (1.0 / 16777216.0)                    # (0, 1)
    return -torch.log(-torch.log(u))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top_k (<=0: off) and top_p (1: off) exclude; x [B, V] scaled logits."""
    vocab = x.shape[1]
    srt, idx = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    srt = srt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs   # mass strictly above this entry
    drop = drop | (before > top_p.unsqueeze(1))
    drop[:, 0] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, srt)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, gen_idx: torch.Tensor, *,
           all_greedy: bool, need_filter: bool,
           suppress_ids: torch.Tensor | None = None,
           suppress_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, int64 [B]. logits float32 [B, V]; temperature 0 = greedy.

    all_greedy / need_filter are host-known flags for the batch (skip the work nobody
    needs). suppress_ids [S] are masked in rows where suppress_rows [B] is true (min_tokens).
    """
    if suppress_ids is not None and suppress_rows is not None:
        cols = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        cols[suppress_ids] = True
        logits = logits.masked_fill(suppress_rows.unsqueeze(1) & cols.unsqueeze(0), float("-inf"))
    greedy_tok = logits.argmax(dim=-1)
    if all_greedy:
        return greedy_tok
    greedy = temperature <= 0.0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    x = logits / t.unsqueeze(1)
    if need_filter:
        x = apply_top_k_top_p(x, top_k, top_p)
    tok = (x + gumbel_noise(seeds, gen_idx, x.shape[1])).argmax(dim=-1)
    return torch.where(greedy, greedy_tok, tok)
