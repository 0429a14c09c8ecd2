"""Triton kernels of the FP8 projections (CUDA; Triton's interpreter runs them on the CPU
for the tests):

- `quantize_tokens`: activations to e4m3 with one scale per token, in one launch (the
  read of the row, its amax and the quantized write), dynamic or with a static scale;
  what `torch._scaled_mm` takes as A before a per-channel-scaled weight.
- `store_fp8_row`: the same for a row already in registers (called from the RMSNorm and
  SiLU·mul kernels when the next projection takes FP8: Linear.takes_fp8).
- `quantize_token_groups`: one scale per token and group of 128 columns (block weights).
- `scale_columns`: a float32 product times the weights' per-channel scales (+ bias), cast
  to the activation dtype, in one launch (after the tensorwise GEMM of a one-token step).
- `block_fp8_matmul`: y = (A · Bᵀ) with A scaled per token and group, B per [bn, bk]
  block (the "fp8" checkpoints' `weight_scale_inv`); accumulates in float32, one scale
  product per K tile.

Grids depend on shapes only and nothing synchronises with the host: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8
from .fp8 import FP8

FP8_MAX = tl.constexpr(fp8.FP8_MAX)     # Triton reads module globals only as constexprs
MIN_AMAX = tl.constexpr(fp8.MIN_AMAX)


@triton.jit
def store_fp8_row(y, offs, mask, q_ptr, s_ptr, row):
    """y (a row, float32, already rounded to the activation dtype; 0 where masked) as e4m3
    with its scale: quantize_tokens' one-pass arithmetic, for the kernels that quantize
    the row they made (RMSNorm, SiLU·mul)."""
    scale = tl.maximum(tl.max(tl.abs(y), 0), MIN_AMAX) / FP8_MAX
    tl.store(s_ptr + row, scale)
    q = tl.clamp(y * (1.0 / scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_tokens_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q,
                         K: tl.constexpr, BLOCK: tl.constexpr, STATIC: tl.constexpr, ONE_PASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_x
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    elif ONE_PASS:
        x = tl.load(row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) / FP8_MAX
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
    if not STATIC:
        tl.store(s_ptr + t, scale)
    inv = 1.0 / scale
    if ONE_PASS and not STATIC:
        q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + t * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            x = tl.load(row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + t * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def quantize_tokens(x: torch.Tensor, static_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], float32 scales [T, 1]); static_scale [1]: that scale for every token."""
    T, K = x.shape
    q = torch.empty((T, K), dtype=FP8, device=x.device)
    if static_scale is not None:
        s = static_scale.view(1, 1).expand(T, 1)
    else:
        s = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    if T == 0:
        return q, s
    # K is a constexpr: a model has two or three input widths, and loops to a constexpr
    # bound also run in Triton's interpreter (3.6 cannot loop to an int argument)
    one_pass = K <= 8192
    block = triton.next_power_of_2(K) if one_pass else 4096
    _quant_tokens_kernel[(T,)](
        x, q, s, static_scale if static_scale is not None else s, x.stride(0), q.stride(0),
        K=K, BLOCK=block, STATIC=static_scale is not None, ONE_PASS=one_pass,
        num_warps=8 if block >= 4096 else 4)
    return q, s


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_x, stride_q, stride_s, GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + t * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + t * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + t * stride_s + g, scale)


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], float32 [T, ⌈K/group⌉])."""
    T, K = x.shape
    G = triton.cdiv(K, group)
    q = torch.empty((T, K), dtype=FP8, device=x.device)
    s = torch.empty((T, G), dtype=torch.float32, device=x.device)
    if T:
        _quant_groups_kernel[(T, G)](x, q, s, K, G, x.stride(0), q.stride(0), s.stride(0),
                                     GROUP=group, num_warps=1 if group <= 128 else 4)
    return q, s


@triton.jit
def _scale_columns_kernel(y_ptr, s_ptr, r_ptr, b_ptr, o_ptr, N, stride_y, stride_o, BLOCK: tl.constexpr,
                          HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y = tl.load(y_ptr + t * stride_y + offs, mask=mask, other=0.0) * tl.load(s_ptr + offs, mask=mask, other=0.0)
    if HAS_ROWS:
        y = y * tl.load(r_ptr + t)
    if HAS_BIAS:
        y = y.to(o_ptr.dtype.element_ty).to(tl.float32) + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + t * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def scale_columns(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  bias: torch.Tensor | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] (float32, or the GEMM's own dtype) * scale float32 [N] (* row_scale float32,
    one per row) (+ bias [N], added after rounding to dtype, as the unfused
    `(y * s).to(dtype) + bias` does) -> dtype [T, N]."""
    T, N = y.shape
    out = torch.empty((T, N), dtype=dtype, device=y.device)
    if T:
        block = 1024
        _scale_columns_kernel[(T, triton.cdiv(N, block))](
            y, scale, row_scale if row_scale is not None else scale, bias if bias is not None else scale,
            out, N, y.stride(0), out.stride(0),
            BLOCK=block, HAS_ROWS=row_scale is not None, HAS_BIAS=bias is not None, num_warps=4)
    return out


@triton.jit
def _block_mm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, GROUP_N, GROUP_K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SWIZZLE: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # tiles in groups of SWIZZLE rows: neighbouring programs share B tiles in L2
    per_group = SWIZZLE * num_n
    first_m = (pid // per_group) * SWIZZLE
    rows = tl.minimum(num_m - first_m, SWIZZLE)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    as_row = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_row = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        g = (k * BLOCK_K) // GROUP_K
        a_s = tl.load(as_row + g)
        b_s = tl.load(bs_row + g)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + cm.to(tl.int64)[:, None] * stride_cm + cn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(cm[:, None] < M) & (cn[None, :] < N))


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a fp8 [M, K] with a_scale [M, K/bk]; b fp8 [N, K] (row-major: the weight) with
    b_scale [⌈N/bn⌉, ⌈K/bk⌉] -> [M, N] in out_dtype."""
    M, K = a.shape
    N = b.shape[0]
    bn, bk = block
    assert a.stride(1) == 1 and b.stride(1) == 1 and bk >= 16 and bk & (bk - 1) == 0
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0:
        return c
    block_m = 16 if M <= 16 else 32 if M <= 64 else 64
    block_n = min(128, bn) if bn & (bn - 1) == 0 else 64
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _block_mm_kernel[grid](a, b, c, a_scale, b_scale, M, N, bn, bk,
                           a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0), b_scale.stride(0),
                           K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, SWIZZLE=8,
                           num_warps=4, num_stages=3)
    return c
