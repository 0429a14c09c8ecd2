"""Fused mixture of experts on CUDA: the tokens each expert received, one grouped GEMM for
w13 (gate and up fused) and one for w2, the routing weights applied in the second.

Alignment (`align`): the T x k (token, expert) pairs are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M, so that every BLOCK_M rows of the sorted
list belong to one expert. Three small launches, no host sync: per-chunk expert counts,
the offsets (one program: each expert's padded start, each chunk's cursor, block -> expert,
the padded total), then each pair written to its place.

GEMM (`_moe_gemm`): program (m, n) multiplies the BLOCK_M rows of sorted block m by
BLOCK_N rows of its expert's weight. The grid is sized for the worst case (every expert
used pads one block), blocks past the device-side total return at once: the launch
depends on shapes only, so a CUDA graph can capture it.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

CHUNK = 128     # (token, expert) pairs per program of the count and scatter launches
TILE = 64       # chunks the offsets program reads at once


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, n_pairs, EP: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=EP)
    e = tl.arange(0, EP)
    counts = tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * EP + e, counts)


@triton.jit
def _offsets_kernel(counts_ptr, cursor_ptr, sorted_ptr, expert_ptr, total_ptr,
                    n_chunks, n_pairs, n_experts, max_len,
                    EP: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr):
    e = tl.arange(0, EP)
    rows = tl.arange(0, TILE)
    counts = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, n_chunks, TILE):
        m = (c0 + rows)[:, None] < n_chunks
        counts += tl.sum(tl.load(counts_ptr + (c0 + rows)[:, None] * EP + e[None, :], mask=m, other=0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    run = ends - padded                    # where each expert's run starts
    # each chunk's cursor per expert: its run's start plus the pairs of earlier chunks
    for c0 in range(0, n_chunks, TILE):
        m = (c0 + rows)[:, None] < n_chunks
        tile = tl.load(counts_ptr + (c0 + rows)[:, None] * EP + e[None, :], mask=m, other=0)
        before = tl.cumsum(tile, axis=0) - tile
        tl.store(cursor_ptr + (c0 + rows)[:, None] * EP + e[None, :], run[None, :] + before, mask=m)
        run += tl.sum(tile, axis=0)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    # the expert of each block (blocks past the total: any valid expert, they are skipped)
    for s0 in range(0, max_len, TILE * BLOCK_M):
        blocks = s0 // BLOCK_M + rows
        past = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + blocks, tl.minimum(past, n_experts - 1), mask=blocks * BLOCK_M < max_len)
    # padding rows name pair n_pairs (out of range: loaded as zeros, never stored)
    for s0 in range(0, max_len, TILE * BLOCK_M):
        offs = s0 + tl.arange(0, TILE * BLOCK_M)
        tl.store(sorted_ptr + offs, tl.full([TILE * BLOCK_M], 0, tl.int32) + n_pairs, mask=offs < max_len)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, n_pairs, EP: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, CHUNK)
    offs = c * CHUNK + i
    m = offs < n_pairs
    ids = tl.load(ids_ptr + offs, mask=m, other=EP)
    # rank among this chunk's earlier pairs of the same expert (keeps token order)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    base = tl.load(cursor_ptr + c * EP + ids, mask=m, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=m)


def align(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """(sorted pair ids [max_len] int32, expert of each block [max_len / block_m] int32,
    padded total [1] int32). Pair p = token * k + slot; padding rows hold T * k."""
    flat = topk_ids.reshape(-1).to(torch.int32)
    n = flat.numel()
    max_len = triton.cdiv(n + min(n_experts, n) * (block_m - 1), block_m) * block_m
    ep = triton.next_power_of_2(n_experts)
    n_chunks = triton.cdiv(n, CHUNK)
    dev = flat.device
    counts = torch.empty((n_chunks, ep), dtype=torch.int32, device=dev)
    cursor = torch.empty_like(counts)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_len // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    _count_kernel[(n_chunks,)](flat, counts, n, EP=ep, CHUNK=CHUNK)
    _offsets_kernel[(1,)](counts, cursor, sorted_ids, expert_ids, total, n_chunks, n, n_experts, max_len,
                          EP=ep, BLOCK_M=block_m, TILE=TILE)
    _scatter_kernel[(n_chunks,)](flat, cursor, sorted_ids, n, EP=ep, CHUNK=CHUNK)
    return sorted_ids, expert_ids, total


@triton.jit
def _moe_gemm(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, total_ptr,
              N, K, n_pairs, stride_am, stride_be, stride_bn, stride_cm,
              TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[pair // TOP_K] @ B[expert]ᵀ (x the pair's routing weight)."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks_n
    pid_n = pid % n_blocks_n
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _config(pairs_per_expert: float, n_out: int) -> dict:
    """Tile sizes: decode-sized batches stream the weights (short M, wide K); prefill
    batches are compute-bound tiles."""
    if pairs_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64 if n_out >= 8192 else 32, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


def _gemm(a, b, c, weights, sorted_ids, expert_ids, total, top_k: int, block_m: int, avg: float) -> None:
    e, n_out, k_dim = b.shape
    cfg = _config(avg, n_out)
    cfg["BLOCK_M"] = block_m
    grid = (sorted_ids.numel() // block_m * triton.cdiv(n_out, cfg["BLOCK_N"]),)
    _moe_gemm[grid](a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, total,
                    n_out, k_dim, c.shape[0], a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                    TOP_K=top_k, MUL_WEIGHT=weights is not None,
                    PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **cfg)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over the k experts of token t: weight * w2[e] @ act(w13[e] @ x[t]).
    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights float32 [T, k]; topk_ids [T, k]."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    avg = t * k / e
    block_m = _config(avg, two_i)["BLOCK_M"]
    sorted_ids, expert_ids, total = align(topk_ids, e, block_m)
    inter = torch.empty((t * k, two_i), dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter, None, sorted_ids, expert_ids, total, k, block_m, avg)
    a2 = act(inter).contiguous()
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    _gemm(a2, w2, out, topk_weights.reshape(-1).float().contiguous(), sorted_ids, expert_ids, total, 1,
          block_m, avg)
    return out.view(t, k, h).sum(dim=1)
