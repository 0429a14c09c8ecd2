"""Write the step's K and V into the paged cache at slot_mapping.

Caches [num_pages, page_size, Hk, D]; slot = page * page_size + offset (int64).
A negative slot (a padded row of a captured batch bucket) is skipped. One
program per token copies all its K and V heads (Hk*D elements each).
FP8 caches (float8_e4m3fn, `--kv-cache-dtype fp8`): K and V are divided by their
per-tensor scales and saturated to ±448 on the way in (KV_FP8 is a constexpr: the
bf16 path compiles as before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_cs, stride_ch,
    HK, PAGE_SIZE, inv_k_scale, inv_v_scale,
    D: tl.constexpr, BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        mask = (h < HK)[:, None]
        dst = page * stride_cp + off * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if KV_FP8:
            k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0)
            v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    T, Hk, D = k.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        Hk, k_cache.shape[1], 1.0 / k_scale, 1.0 / v_scale,
        D=D, BLOCK_H=triton.next_power_of_2(Hk), KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )
