"""Rotary position embedding (HF rotate-half style), q and k in one launch.

cos_sin_cache [max_pos, D]: cos of the D/2 frequencies in the first half of a
row, sin in the second. out1 = x1*cos - x2*sin; out2 = x2*cos + x1*sin, in
float32, rounded once. One program per token handles all q and k heads, so the
cos/sin row is read once per token. q and k may be strided views of a fused
qkv projection (last dim contiguous); the outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_one(x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
              H, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < H)[:, None]
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    obase = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HQ, HK,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)
    _rope_one(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
              HQ, HALF, BLOCK_HQ)
    _rope_one(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
              HK, HALF, BLOCK_HK)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor):
    T, Hq, D = q.shape
    Hk = k.shape[1]
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, "head_dim/2 must be a power of two"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hk, D), dtype=k.dtype, device=k.device)
    if T:
        _rope_kernel[(T,)](
            q, k, qo, ko, positions, cs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cs.stride(0),
            Hq, Hk,
            HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
            num_warps=4,
        )
    return qo, ko
