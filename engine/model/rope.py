"""Rotary position embeddings: the cos/sin cache for every RoPE scaling the served
families use (default, linear, dynamic, yarn, llama3, longrope), computed as transformers'
`ROPE_INIT_FUNCTIONS` do (float32 inverse frequencies, cos/sin times the attention factor).

Two scalings in transformers change with the length of the sequence being run; a KV
cache holds keys rotated once, so the cache fixes them per position instead:
- dynamic (NTK): the base is stretched for the longest length the engine serves
  (max_model_len). It equals transformers exactly while max_model_len stays within
  max_position_embeddings, where dynamic scaling is a no-op.
- longrope: positions below original_max_position_embeddings use the short factors and
  positions past it the long ones. transformers switches every position of a sequence
  to the long factors once the sequence is longer; the two agree for every sequence
  within the original length.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
             max_position_embeddings: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] float32, attention factor) for a sequence of
    seq_len tokens, as transformers' rope init function of the type returns them."""
    d = head_dim
    exps = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    plain = 1.0 / (theta ** exps)
    rtype = scaling["rope_type"] if scaling else "default"
    if rtype == "default":
        return plain, 1.0
    s = scaling
    if rtype == "linear":
        return plain / float(s["factor"]), 1.0
    if rtype == "dynamic":
        factor = float(s["factor"])
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = theta * ((factor * n / max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** exps), 1.0
    if rtype == "llama3":
        return _llama3(plain, s), 1.0
    if rtype == "yarn":
        return _yarn(d, theta, s, max_position_embeddings)
    return _longrope(d, theta, s, max_position_embeddings, seq_len)


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(is_medium, smoothed, inv_l)


def _yarn(d: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _longrope(d: int, theta: float, s: dict[str, Any], max_pos: int,
              seq_len: int | None) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = s["long_factor"] if seq_len and seq_len > orig else s["short_factor"]
    exps = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** exps), float(attn)


def _table(inv: torch.Tensor, attn: float, positions: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions, inv)
    return torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1)


def cos_sin_cache(mc, max_pos: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_pos, head_dim]: cos in the first half, sin in the second (transformers'
    values, float32 then cast to dtype). mc: hf_config.ModelConfig. Dynamic scaling is
    stretched for sequences of max_pos - 1 tokens: the runner sizes the cache one row
    past max_model_len."""
    s = mc.rope_scaling
    t = torch.arange(max_pos, dtype=torch.float32)
    if s and s["rope_type"] == "longrope":
        orig = s["original_max_position_embeddings"]
        short = inv_freq(mc.head_dim, mc.rope_theta, s, mc.max_position_embeddings, orig)
        long = inv_freq(mc.head_dim, mc.rope_theta, s, mc.max_position_embeddings, orig + 1)
        table = torch.cat([_table(*short, t[:orig]), _table(*long, t[orig:])])
    else:
        table = _table(*inv_freq(mc.head_dim, mc.rope_theta, s, mc.max_position_embeddings, max_pos - 1), t)
    return table.to(dtype).to(device)
