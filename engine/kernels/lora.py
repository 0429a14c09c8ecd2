"""Multi-LoRA shrink and expand: y[t] += (x[t] A_sᵀ) B_sᵀ with s the adapter slot of row t.

Rows come grouped by slot (`order`, with each slot's `starts` / `counts`: a counting sort
done on the device, see engine/lora/slabs.py), so a program tiles BLOCK_M rows of ONE
adapter and reads that adapter's matrices once per tile (tl.dot), not once per row. Slot
0 ("no adapter") gets no program at all: base rows in a mixed batch cost nothing here.
Every grid is fixed by shapes (programs past a slot's rows return at once), nothing syncs
with the host: the kernels are captured in the decode CUDA graphs.

- shrink: xa [T, R] (float32) = x A_sᵀ over the projection's stacked A [S, R, K], split
  over K for parallelism (a decode step has few rows per adapter); the partial sums are
  added by one torch sum, so results do not depend on scheduling (no atomics).
- expand: y[:, segment j] += xa[:, j*Rmax:(j+1)*Rmax] B_s[segment j]ᵀ, in place, for the
  up to three output segments of a fused projection, one launch for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr,
                   T, K, R, k_per_split,
                   stride_xt, stride_as, stride_ar, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    s = tl.program_id(0) + 1                       # slot 0 (no adapter) has no program
    m0 = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    count = tl.load(counts_ptr + s)
    if m0 >= count:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + s) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = split * k_per_split
    a_base = a_ptr + s.to(tl.int64) * stride_as
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    out = out_ptr + split.to(tl.int64) * T * stride_ot
    tl.store(out + rows[:, None] * stride_ot + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(y_ptr, xa_ptr, b_ptr, order_ptr, starts_ptr, counts_ptr,
                   n1, n2, n3, t1, t2, rank,
                   stride_yt, stride_xat, stride_bs, stride_bn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   IEEE: tl.constexpr):
    s = tl.program_id(0) + 1
    m0 = tl.program_id(1) * BLOCK_M
    tile = tl.program_id(2)
    count = tl.load(counts_ptr + s)
    if m0 >= count:
        return
    # which output segment this column tile is in: t1, t2 = tiles of segments 1 and 2
    seg = (tile >= t1).to(tl.int32) + (tile >= t1 + t2).to(tl.int32)
    seg_n0 = tl.where(seg == 0, 0, tl.where(seg == 1, n1, n1 + n2))
    seg_n = tl.where(seg == 0, n1, tl.where(seg == 1, n2, n3))
    seg_t0 = tl.where(seg == 0, 0, tl.where(seg == 1, t1, t1 + t2))
    offs_n = (tile - seg_t0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < seg_n
    cols = seg_n0 + offs_n
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + s) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    xa = tl.load(xa_ptr + rows[:, None] * stride_xat + seg * rank + offs_r[None, :],
                 mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    bt = tl.load(b_ptr + s.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None],
                 mask=mask_n[None, :] & mask_r[:, None], other=0.0)
    if IEEE:
        d = tl.dot(xa.to(bt.dtype), bt, input_precision="ieee")
    else:
        d = tl.dot(xa.to(bt.dtype), bt)
    ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + d).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(T: int) -> int:
    return 16 if T <= 256 else 64


def lora_shrink(x: torch.Tensor, A: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """x [T, K], A [S, R, K] -> xa [T, R] float32 (rows of slot 0: undefined, never read)."""
    T, K = x.shape
    S, R, _ = A.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    bm, bk = _block_m(T), 64
    # enough K splits that a step with a few rows per adapter still fills the GPU; a big
    # prefill has programs enough without (and would pay T x R floats per split)
    splits = max(1, min(32, K // 256, 2048 // max(T, 1)))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty(splits, T, R, dtype=torch.float32, device=x.device)
    if T and S > 1:
        _shrink_kernel[(S - 1, triton.cdiv(T, bm), splits)](
            x, A, part, order, starts, counts, T, K, R, k_per_split,
            x.stride(0), A.stride(0), A.stride(1), part.stride(1),
            BLOCK_M=bm, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_K=bk,
            IEEE=x.dtype == torch.float32, num_warps=4)
    return part[0] if splits == 1 else part.sum(0)


def lora_expand(y: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
                order: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> None:
    """y [T, N] += per segment j: xa[:, j*Rmax:(j+1)*Rmax] B[slot, segment j]ᵀ, in place."""
    T = y.shape[0]
    S, N, rank = B.shape
    if not T or S == 1:
        return
    assert y.stride(-1) == 1 and len(segments) <= 3
    bm, bn = _block_m(T), 64
    n = list(segments) + [0] * (3 - len(segments))
    tiles = [triton.cdiv(v, bn) for v in n]
    _expand_kernel[(S - 1, triton.cdiv(T, bm), sum(tiles))](
        y, xa, B, order, starts, counts, n[0], n[1], n[2], tiles[0], tiles[1], rank,
        y.stride(0), xa.stride(0), B.stride(0), B.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        IEEE=y.dtype == torch.float32, num_warps=4)
