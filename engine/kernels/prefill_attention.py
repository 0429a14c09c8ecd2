"""Paged causal prefill attention (flash-attention style), with a cached prefix.

q [T, Hq, D] packs the new tokens of B sequences (cu_seqlens_q [B+1]); the
chunk of sequence b is its *last* q_len tokens of context_lens[b] tokens in the
cache (write_kv has already put this step's K/V there), so a chunked prefill or
a prompt with a cached prefix needs nothing else. K/V are read from the pages
through block_tables.

Grid (T // BLOCK_M + B, Hq): a fixed grid from shapes alone (no max q_len on the
host, so no sync). Program m finds its sequence by binary search over
cu_seqlens_q in block units (block index of sequence b starts at
cu[b] // BLOCK_M + b, which is strictly increasing) and leaves early when its
block is past the sequence's end. Key tiles wholly before the block's first
query need no mask; the diagonal tiles are masked.

Sliding window (WINDOW > 0): only the tiles holding keys within WINDOW of the block's
queries are read, all of them masked. Soft-capping (SOFTCAP): cap * tanh(s / cap) on
each score. Both constexpr: the plain path compiles as before.
FP8 KV pages (KV_FP8, constexpr): tiles widened to q's dtype on load, K's scale folded
into the score scale on the host, V's multiplying the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _softcap_factors, _tanh, dot_precision

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_ptr, pid, B, BLOCK_M: tl.constexpr):
    # both bounds as int32 tensors from the start (B == 1 is specialised to a constexpr)
    lo = pid * 0
    hi = lo + B
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_M + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, head_off, n0, q_pos, kv_end,
               qk_scale, cap_in, cap_out, stride_cp, stride_cs,
               PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               KV_FP8: tl.constexpr, PRECISION: tl.constexpr):
    offs = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if MASKED:
        nmask = offs < kv_end
        page = tl.load(bt_row + offs // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs // PAGE_SIZE).to(tl.int64)
    row = page * stride_cp + (offs % PAGE_SIZE) * stride_cs + head_off
    if MASKED:
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(kc_ptr + row[:, None] + d[None, :])
    if KV_FP8:
        k = k.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:
        qk = _tanh(qk * cap_in) * cap_out
    if MASKED:
        keep = (offs[None, :] <= q_pos[:, None]) & nmask[None, :]
        if WINDOW > 0:
            keep = keep & (offs[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(keep, qk, float("-inf"))
    # the softmax scale (times log2 e) is folded into one FMA per score: exp2(qk*s - m)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if WINDOW > 0:
        # a row whose window starts past this tile has seen no key yet (m = -inf):
        # shift by 0 so its alpha and p are 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(qk * qk_scale - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
    else:
        v = tl.load(vc_ptr + row[:, None] + d[None, :])
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, cl_ptr, o_ptr,
    qk_scale, cap_in, cap_out, v_scale, B,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_cs, stride_ch, stride_btb,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    seq = _find_seq(cu_ptr, pid, B, BLOCK_M)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    blk = pid - (q_start // BLOCK_M + seq)
    if blk * BLOCK_M >= q_len:
        return
    ctx = tl.load(cl_ptr + seq)
    prefix = ctx - q_len
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    q_pos = prefix + offs_m
    d = tl.arange(0, D)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    head_off = (h // GROUP).to(tl.int64) * stride_ch

    first_pos = prefix + blk * BLOCK_M
    kv_end = prefix + tl.minimum((blk + 1) * BLOCK_M, q_len)
    if WINDOW > 0:
        # the block's first query sees keys from first_pos - WINDOW + 1 on
        full_end = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        full_end = (first_pos // BLOCK_N) * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, head_off, n0,
                                       q_pos, kv_end, qk_scale, cap_in, cap_out, stride_cp, stride_cs,
                                       PAGE_SIZE, D, BLOCK_N, False, WINDOW, SOFTCAP, KV_FP8,
                                       PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_row, head_off, n0,
                                   q_pos, kv_end, qk_scale, cap_in, cap_out, stride_cp, stride_cs,
                                   PAGE_SIZE, D, BLOCK_N, True, WINDOW, SOFTCAP, KV_FP8,
                                   PRECISION)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


# Measured on the H200 (docs/perf.md "Kernels", graph-timed): M=64 N=64 w=4 st=3 against
# M=128 N=64 w=8 st=3: 1K prompt 51 vs 57 us, 2K chunk after a 14K prefix
# 1518 vs 1612 us, 200 x 24-token prompts 156 vs 287 us, 16K prompt 6119 vs 5994 us.
DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float,
                      *, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                      block_m: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    T, Hq, D = q.shape
    _, page_size, Hk, Dk = k_cache.shape
    assert Dk == D and Hq % Hk == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    if q.stride(-1) != 1:
        q = q.contiguous()
    B = cu_seqlens_q.shape[0] - 1
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    block_m = block_m or DEFAULT_BLOCK_M
    block_n = block_n or DEFAULT_BLOCK_N
    grid = (T // block_m + B, Hq)
    scale = float(scale) * k_scale   # scores of an FP8 cache: q . k8 * k_scale
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        1.0 if softcap else scale * _LOG2E, *_softcap_factors(scale, softcap), float(v_scale), B,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        PAGE_SIZE=page_size, GROUP=Hq // Hk, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        WINDOW=int(window), SOFTCAP=bool(softcap), KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or DEFAULT_NUM_WARPS, num_stages=num_stages or DEFAULT_NUM_STAGES,
    )
    return out
