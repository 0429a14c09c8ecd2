"""Rotary position embedding (HF rotate-half style), q and k in one launch.

cos_sin_cache [max_pos, D]: cos of the D/2 frequencies in the first half of a
row, sin in the second. out1 = x1*cos - x2*sin; out2 = x2*cos + x1*sin, in
float32, rounded once. One program per token handles all q and k heads, so the
cos/sin row is read once per token. q and k may be strided views of a fused
qkv projection (last dim contiguous); the outputs are new contiguous tensors.

`rope_write_kv` also writes the rotated K and the step's V into the paged cache
(kv_cache.py's layout and rules: a negative slot is skipped, an FP8 cache divides by
its scale and saturates), so a layer launches one kernel for both, not two (what that
saves: docs/perf.md "Kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_one(x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
              H, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates token t's H heads into o; returns the two rotated halves, rounded to o's
    dtype (what a cache write of o would read back)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (h < H)[:, None]
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(o_ptr.dtype.element_ty)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(o_ptr.dtype.element_ty)
    obase = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _to_cache(x, cache_ptr, inv_scale, KV_FP8: tl.constexpr):
    if KV_FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HQ, HK,
    v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh, stride_cp, stride_cs_tok, stride_ch,
    PAGE_SIZE, inv_k_scale, inv_v_scale,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    WRITE_KV: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)
    _rope_one(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
              HQ, HALF, BLOCK_HQ)
    k1, k2 = _rope_one(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                       HK, HALF, BLOCK_HK)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_HK)
            mask = (h < HK)[:, None]
            dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs_tok + h[:, None] * stride_ch + d[None, :]
            tl.store(kc_ptr + dst, _to_cache(k1, kc_ptr, inv_k_scale, KV_FP8), mask=mask)
            tl.store(kc_ptr + dst + HALF, _to_cache(k2, kc_ptr, inv_k_scale, KV_FP8), mask=mask)
            src = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
            v1 = tl.load(src, mask=mask)
            v2 = tl.load(src + HALF, mask=mask)
            tl.store(vc_ptr + dst, _to_cache(v1, vc_ptr, inv_v_scale, KV_FP8), mask=mask)
            tl.store(vc_ptr + dst + HALF, _to_cache(v2, vc_ptr, inv_v_scale, KV_FP8), mask=mask)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor):
    return _rope(q, k, positions, cos_sin_cache)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0):
    """apply_rope, and the rotated k with v written to the cache at slot_mapping, one launch."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if v.stride(-1) != 1:
        v = v.contiguous()
    return _rope(q, k, positions, cos_sin_cache, (v, k_cache, v_cache, slot_mapping, k_scale, v_scale))


def _rope(q, k, positions, cos_sin_cache, kv=None):
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
    if kv is None:   # no cache to write: the cache arguments are placeholders, never read
        v, kc, vc, slots, k_scale, v_scale = q, q, q, positions, 1.0, 1.0
        cache_strides, page_size = (0, 0, 0), 1
    else:
        v, kc, vc, slots, k_scale, v_scale = kv
        cache_strides, page_size = kc.stride()[:3], kc.shape[1]
    if T:
        _rope_kernel[(T,)](
            q, k, qo, ko, positions, cs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cs.stride(0),
            Hq, Hk,
            v, kc, vc, slots, v.stride(0), v.stride(1), *cache_strides,
            page_size, 1.0 / k_scale, 1.0 / v_scale,
            HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
            WRITE_KV=kv is not None, KV_FP8=kv is not None and kc.dtype == torch.float8_e4m3fn,
            num_warps=4,
        )
    return qo, ko
