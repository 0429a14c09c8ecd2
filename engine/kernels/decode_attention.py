"""Paged decode attention (one query token per sequence), split-K / flash-decoding.

Layout (docs/engine-interface.md): q [B, Hq, D]; k_cache, v_cache
[num_pages, page_size, Hk, D]; block_tables int32 [B, max_pages];
context_lens int32 [B] including the current token. GQA: Hq = GROUP * Hk.

Stage 1, grid (B, Hk, NUM_SPLITS): each program takes the GROUP query heads
that share one KV head (padded to 16 rows for tl.dot) and one slice of the
sequence, reads its K/V pages straight from the pool through the block table
(BLOCK_N tokens a tile, each token row 2*D contiguous bytes), and keeps an
online softmax in float32 (exp2 domain). So each K/V byte is read once for all
the heads of its group. The slice length is computed *in the kernel* from
context_lens (ceil(ctx / NUM_SPLITS) rounded up to BLOCK_N), so the grid depends
only on shapes: a CUDA graph captured once serves every context length, and a
single 16K sequence still spreads over the whole GPU.
Stage 2, grid (B, Hq): merges the splits with their log-sum-exp. With
NUM_SPLITS == 1 stage 1 writes the output itself and stage 2 is skipped.

Sliding window (WINDOW > 0, Mistral / Gemma local layers): the splits cover only the
last WINDOW tokens. Soft-capping (SOFTCAP, Gemma 2): scores become cap * tanh(s / cap)
before the softmax. Both are constexpr, so the plain Llama path compiles as before.
FP8 KV pages (KV_FP8, constexpr): K and V tiles are widened to q's dtype as they are
loaded; K's scale is folded into the score scale on the host, V's multiplies the output.

No host synchronisation, no data-dependent allocation: graph-capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both saturations, no libdevice needed
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, cl_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale, cap_in, cap_out, v_scale,
    stride_qb, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_btb,
    stride_ob, stride_oh,
    HQ,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)

    ctx = tl.load(cl_ptr + b)
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    else:
        lo = ctx * 0
    split_len = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + s * split_len
    end = tl.minimum(start + split_len, ctx)

    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    qh = kvh * GROUP + h
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch

    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end
        page = tl.load(bt_row + offs // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
        row = page * stride_cp + (offs % PAGE_SIZE) * stride_cs + head_off
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        if SOFTCAP:
            qk = _tanh(tl.dot(q, tl.trans(k), input_precision=PRECISION) * cap_in) * cap_out
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if KV_FP8:
        o = o * v_scale
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        # mid_o [B, HQ, NUM_SPLITS, D], mid_lse [B, HQ, NUM_SPLITS], both contiguous
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        mrow = (b * HQ + qh) * NUM_SPLITS + s
        tl.store(mid_lse_ptr + mrow, lse, mask=hmask)
        tl.store(mid_o_ptr + mrow[:, None] * D + d[None, :], o, mask=hmask[:, None])


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    HQ,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    base = (b * HQ + h) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    w = tl.where(live, tl.exp2(lse - tl.where(live, m, 0.0)), 0.0)
    total = tl.sum(w, 0)
    o = tl.load(mid_o_ptr + (base + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, sm_count: int,
                      min_tokens_per_split: int = 256, max_splits: int = 64) -> int:
    """Splits from shapes only (a captured graph serves every context length).

    About two programs per SM for batches over 8; four for batches up to 8, where one long
    sequence among short ones must still spread over the GPU by itself (each sequence's
    slice length is ctx/splits, so short sequences leave most of their splits idle).
    Measured on the H200 (docs/perf.md "Kernels", graph-timed): B=32 at 4K context
    146 us with 4 splits, 137 us with 2; B=1 at 16K flat from 64 to 128 splits, 43 us at
    16; B=4 with one 16K sequence 32 us with 32 splits, 47 us with 16; B=200 best unsplit.
    """
    per = batch * num_kv_heads
    want = triton.cdiv((4 if batch <= 8 else 2) * sm_count, per)
    cap = max(1, max_tokens // min_tokens_per_split)
    s = min(want, cap, max_splits)
    return 1 if s <= 1 else triton.next_power_of_2(s)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 stays IEEE (a float32 model is the exact reference
    the tests compare with; TF32 would round q.k to 10 bits), 16-bit inputs are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _softcap_factors(scale: float, softcap: float) -> tuple[float, float]:
    """(cap_in, cap_out): score = tanh(qk * cap_in) * cap_out, in the exp2 domain."""
    if not softcap:
        return 1.0, 1.0
    return float(scale) / softcap, softcap * _LOG2E


DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     *, window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                     num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """k_scale, v_scale: an FP8 cache's per-tensor scales (value = fp8 * scale)."""
    B, Hq, D = q.shape
    _, page_size, Hk, Dk = k_cache.shape
    assert Dk == D and Hq % Hk == 0, (q.shape, k_cache.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = Hq // Hk
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_n = block_n or DEFAULT_BLOCK_N
    if num_splits is None:
        dev = q.device.index if q.device.type == "cuda" else 0
        span = block_tables.shape[1] * page_size
        num_splits = choose_num_splits(B, Hk, min(span, window) if window else span,
                                       _sm_count(dev if dev is not None else 0))
    block_h = max(16, triton.next_power_of_2(group))
    if num_splits > 1:
        mid_o = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    scale = float(scale) * k_scale   # scores of an FP8 cache: q . k8 * k_scale
    _decode_split_kernel[(B, Hk, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, mid_o, mid_lse,
        scale * _LOG2E, *_softcap_factors(scale, softcap), float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        Hq,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_H=block_h, D=D,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, WINDOW=int(window), SOFTCAP=bool(softcap),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or DEFAULT_NUM_WARPS,
        num_stages=num_stages or DEFAULT_NUM_STAGES,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, Hq)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), Hq,
            D=D, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out

