"""FP8 (e4m3) arithmetic in torch: quantizing weights and activations, dequantizing, and
the reference product every device can run (the CPU's path, and the check of the CUDA
kernels). Scales follow vLLM: value = fp8 * scale, scale = amax / 448.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448
MIN_AMAX = 1e-12                        # an all-zero row gets a tiny scale, not a division by 0


class Fp8Acts(NamedTuple):
    """A step's activations already quantized per token, by the kernel that made them (the
    RMSNorm or SiLU·mul before a projection that asked for them: Linear.takes_fp8)."""
    q: torch.Tensor       # e4m3 [T, K]
    scale: torch.Tensor   # float32 [T, 1]


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to ±448, in e4m3 (scale broadcasts over x)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (a weight's output channel, or an activation's token):
    (fp8 [R, C], float32 scales [R])."""
    scale = w.float().abs().amax(dim=-1).clamp_(min=MIN_AMAX) / FP8_MAX
    return quantize(w, scale.unsqueeze(-1)), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row and group of `group` columns: (fp8 [R, C], float32 [R, C/group])."""
    r, c = x.shape
    g = x.float().view(r, c // group, group)
    scale = g.abs().amax(dim=-1).clamp_(min=MIN_AMAX) / FP8_MAX
    return quantize(g, scale.unsqueeze(-1)).view(r, c), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per [bn, bk] block (edge blocks partial): (fp8 [N, K], float32 [⌈N/bn⌉, ⌈K/bk⌉])."""
    n, k = w.shape
    bn, bk = block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    wp = F.pad(w.float(), (0, pk - k, 0, pn - n)).view(pn // bn, bn, pk // bk, bk)
    scale = wp.abs().amax(dim=(1, 3)).clamp_(min=MIN_AMAX) / FP8_MAX
    q = quantize(wp, scale[:, None, :, None]).view(pn, pk)[:n, :k]
    return q.contiguous(), scale


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] from fp8 weights and per-block scales."""
    bn, bk = block
    n, k = w.shape
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * s


def qdq_rows(x: torch.Tensor) -> torch.Tensor:
    """x through per-token FP8 and back (W8A8 emulated), in x's dtype."""
    q, s = quantize_rows(x)
    return (q.float() * s.unsqueeze(-1)).to(x.dtype)


def qdq_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    q, s = quantize_groups(x, group)
    return (q.float().view(*s.shape, group) * s.unsqueeze(-1)).view(x.shape).to(x.dtype)


def qdq_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (quantize(x, scale).float() * scale).to(x.dtype)
