"""The small-M FP8 product: y = x · (W · s)ᵀ (+ b) with the activations as they are
(bf16 / fp16: W8A16) and e4m3 weights, in Triton.

At decode sizes (M up to a few dozen tokens) a step reads every weight once and does
~M multiply-adds per byte: the time is the weight bytes over HBM bandwidth, which FP8
halves, if nothing else costs. So no activation-quantization kernel runs first, and the
grid covers every SM: each program takes BLOCK_N output columns of all M rows, and when
those programs are fewer than `WAVES` per SM, K is split among more of them (split-K),
each writing float32 partials that a second kernel sums, adding the bias and casting.
A weight tile is widened to the activations' dtype in registers (exact: e4m3 values are
bf16 / fp16 values) and multiplied on the tensor cores in float32; the scale multiplies
the float32 accumulator: once at the end per output channel, or per K tile for
[bn, bk]-block scales (a K tile never crosses a block).

Two kernels compute it, `KERNEL` picks per kind of weight scales (gpu/fp8_gemm_bench.py
times both; H200, docs/perf.md "FP8": "ab" for per-channel scales, 95-97
vs 106-108 us a layer at M = 1-16 with its best tiles; "swap_ab" for block scales, 117-159
vs 124-192 us at M = 1-64):
- "ab": acc[BLOCK_M, BLOCK_N] = x tile · wᵀ tile, the weights as the MMA's B operand. At
  BLOCK_M = 16 Triton gives it Ampere's synchronous mma.sync.m16n8k16 (Hopper's wgmma
  needs 64 rows of A); it reads the weights at 1.4-2.5 TB/s on the H200 (docs/perf.md
  "FP8").
- "swap_ab": yᵀ = (W·s) xᵀ, acc[BLOCK_N, BLOCK_M] = w tile · xᵀ tile, the weights as the
  MMA's A operand (64-128 rows: wgmma's M) and the few activation rows as its N (16 at
  decode). wgmma takes A from registers: a weight tile is loaded as 16-byte vectors along
  K (rows of the row-major [N, K] weight), widened in registers and fed to the tensor
  cores asynchronously, so the next tiles' loads overlap the MMA; larger K tiles
  (256-512) keep more bytes in flight per SM. Weight rows past N are read wrapped
  (`% N`) and never stored, so with K a multiple of BLOCK_K no weight load is masked.
  Compiled ahead for sm_90a (Triton 3.6, ptxas -v, no GPU): wgmma.m64n16k16 with A in
  registers, 16-byte cp.async for the weights, no spills at any tile the bench sweeps.

There is no separate no-tensor-core GEMV for M <= 4: on the H200 one measures no faster
than "ab" at M = 1 (96.3 vs 96.0 us a layer, docs/perf.md "FP8").

Split-K partials are summed by a second kernel, not float32 atomics into a zeroed
buffer: atomics need the zeroing and a cast to the output dtype (three launches, not
two) and sum in a different order each run, and decoding must repeat exactly; the
partials move 2·split·M·N·4 bytes, which `split_k` keeps under SPLIT_BYTES of the weights.

Every choice (kernel, tiles, split) is made on the host from the shapes: the same M gives
the same launch, so a captured CUDA graph stays valid, and nothing synchronises. K and the
split's length are run-time arguments, so a model compiles a handful of variants (tile
height, block scales, split or not, bias), not one per shape and batch. The tile
defaults are first estimates that gpu/fp8_gemm_bench.py sweeps on the device. Triton's
interpreter loops to a run-time bound with tests/kernel_checks.py's patch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: what gpu/fp8_gemm_bench.py sweeps."""
    block_n: int          # output columns per program
    block_k: int          # K per step (cut to the weight block's bk)
    num_stages: int = 4   # K tiles in flight (the software pipeline's depth)
    num_warps: int = 4
    hints: bool = False   # swap_ab: tl.multiple_of / max_contiguous on the K offsets


KERNEL = {"row": "ab", "block": "swap_ab"}   # per weight scales: the faster on the H200 (above)
# "ab": 32 x 128 beat the first 64 x 128 on every projection at M = 1 and 16 (the sweep above)
TILES = {"ab": Tiles(32, 128), "swap_ab": Tiles(64, 256, hints=True)}
WAVES = 2           # programs per SM wanted before K is split
SPLIT_BYTES = 0.25  # the float32 partials may move at most this share of the weight bytes
PARTIAL_BLOCK = 1024


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, GROUP_N, GROUP_K,
                  stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k0 = pid_s * K_SPLIT
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        k_ok = k0 + kk + offs_k < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(x.dtype)
        if BLOCKWISE:
            s = tl.load(s_ptr + (offs_n // GROUP_N) * stride_sn + (k0 + kk) // GROUP_K, mask=n_ok, other=0.0)
            acc += tl.dot(x, w) * s[None, :]
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCKWISE:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS and not PARTIAL:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + pid_s * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a16_swap_ab_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, GROUP_N, GROUP_K,
                          stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                          EVEN_K: tl.constexpr, HINTS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = offs_n % N   # in bounds: the weight loads need no mask; the store drops the copies
    m_ok = offs_m < M     # x's padding rows (M < BLOCK_M): masked, so zero-filled and never read
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_s * K_SPLIT
    if HINTS:
        offs_k = tl.max_contiguous(tl.multiple_of(offs_k, BLOCK_K), BLOCK_K)
        k0 = tl.multiple_of(k0, BLOCK_K)
    k_end = tl.minimum(k0 + K_SPLIT, K)
    w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + (k0 + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = k + offs_k < K
            x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        w = w.to(x.dtype)
        if BLOCKWISE:
            s = tl.load(s_ptr + (rows_n // GROUP_N) * stride_sn + k // GROUP_K)
            acc += tl.dot(w, x) * s[:, None]
        else:
            acc = tl.dot(w, x, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCKWISE:
        acc = acc * tl.load(s_ptr + rows_n)[:, None]
    if HAS_BIAS and not PARTIAL:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    out = y_ptr + pid_s * stride_ys + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & m_ok[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLITS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132   # Triton's interpreter: the H200's, so the CPU tests take its splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def split_k(M: int, N: int, K: int, block_n: int, block_k: int, sms: int) -> int:
    """How many programs share each output tile's K: doubled while the grid is under
    WAVES programs per SM, every split keeps a K tile, and the partials stay small."""
    programs = triton.cdiv(M, block_m(M)) * triton.cdiv(N, block_n)
    tiles_k = triton.cdiv(K, block_k)
    split = 1
    while (programs * split < WAVES * sms and split * 2 <= tiles_k
           and 2 * split * (2 * M * 4) <= SPLIT_BYTES * K):   # per column: float32 partials written
        split *= 2                                              # and read, against K weight bytes
    return split


def w8a16_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 block: tuple[int, int] | None = None, *, kernel: str | None = None, tiles: Tiles | None = None,
                 split: int | None = None) -> torch.Tensor:
    """x [M, K] bf16 / fp16; w e4m3 [N, K] row-major (the weight); scale float32 [N] per
    output channel or, with block=(bn, bk), [⌈N/bn⌉, ⌈K/bk⌉]; bias [N] -> [M, N] in x's
    dtype. kernel ("ab" / "swap_ab", None: KERNEL's for the scales), tiles (None: its TILES)
    and split (None: `split_k`'s) are the bench's sweep."""
    kernel = kernel or KERNEL["block" if block is not None else "row"]
    t = tiles or TILES[kernel]
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    assert w.stride(1) == 1 and w.shape[1] == K
    block_k = t.block_k
    if block is not None:
        block_k = min(block_k, block[1])   # a K tile within one block of scales
        assert block[1] % block_k == 0
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    split = split or split_k(M, N, K, t.block_n, block_k, _sm_count(x.device))
    k_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_split)    # no split left without K
    partial = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    bm = block_m(M)
    bn_, bk_ = block or (1, 1)
    args = (x, w, scale, bias if bias is not None else scale, partial, M, N, K, k_split, bn_, bk_,
            x.stride(0), w.stride(0), scale.stride(0), N, M * N)
    consts = dict(BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=block_k, BLOCKWISE=block is not None,
                  HAS_BIAS=bias is not None, PARTIAL=split > 1, num_warps=t.num_warps, num_stages=t.num_stages)
    grid = (triton.cdiv(N, t.block_n), split, triton.cdiv(M, bm))
    if kernel == "swap_ab":
        _w8a16_swap_ab_kernel[grid](*args, EVEN_K=K % block_k == 0, HINTS=t.hints, **consts)
    else:
        _w8a16_kernel[grid](*args, **consts)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, PARTIAL_BLOCK),)](
            partial, bias if bias is not None else partial, y, M * N, N, SPLITS=split,
            HAS_BIAS=bias is not None, BLOCK=PARTIAL_BLOCK, num_warps=4)
    return y
