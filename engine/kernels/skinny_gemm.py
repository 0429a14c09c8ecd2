"""Skinny GEMMs in Triton: y = x · Wᵀ for few rows of activations (M from 1 to a few
hundred: decode steps) against a large nn.Linear weight W [N, K], in bf16 / fp16 or in
FP8 (e4m3, per-token activation scales × per-channel weight scales).

Why: at 200 decode streams on the H200 the Llama-3-8B GEMMs run at about 56 % of their
roofline bound through cuBLAS (F.linear) and at about 46 % on the FP8 row-wise path
(torch._scaled_mm): docs/perf.md "A decode step against its bounds" (and docs/perf.md
"FP8"). These kernels are candidates to beat them, taken only where the device measured
one faster:

    python3 gpu/skinny_gemm_bench.py --out $OUT/skinny.json

times every `CONFIGS` entry at the 8B shapes against cuBLAS and writes the best
configuration per shape and M, the table gemm_table.py loads at engine start.

How: one program computes a tile of BLOCK_M tokens × BLOCK_N output channels over a K
slice, accumulating in float32 on the tensor cores. Two layouts (`SkinnyConfig.swap_ab`):
- no swap: acc[BLOCK_M, BLOCK_N] = x tile · Wᵀ tile, the tokens as the MMA's M side.
  Hopper's wgmma wants 64 rows of A, so at BLOCK_M < 64 Triton falls back to mma.sync.
- swap-AB: yᵀ = W · xᵀ, acc[BLOCK_N, BLOCK_M] = W tile · xᵀ tile: the large N fills the
  MMA's M side (64-128 rows, wgmma) and the few tokens its N side (16-64), so a decode
  step wastes no MMA rows on padding tokens.
Rows past M or N are read wrapped (`% M`, `% N`) and never stored, so loads need no row
masks; K is masked only when BLOCK_K does not divide it (EVEN_K). The M tiles of one N
tile are neighbours in the launch order (grid axis 0), so when several M tiles read the
same weight tile at the same time they share it through L2, not HBM.

Split-K (SPLIT_K > 1): each program reduces one K slice and writes float32 partials
[split, M, N]; a second kernel sums them in split order, adds the bias and casts. Not
fp32 atomics: those sum in a different order each run, and greedy decoding must repeat
exactly; the split-K result is deterministic (same inputs, same config: same bits).
Stream-K (`stream_k`): a tile grid that leaves SMs idle in its last wave (qkv at 200
tokens: 96 weight strips of 64 rows for 132 SMs) is replaced by one program per SM; the
(tile, K step) iterations, tile-major, are cut in equal runs, one a program. A program
stores the tiles it covers whole and writes the at most two pieces of tiles its run starts
or ends inside as float32 partials; a fixup kernel sums each cut tile's pieces in program
order (deterministic again, no spin-waits on other programs), adds the bias and casts.
FP8 scales multiply the float32 accumulator in the epilogue (the partials are already
scaled); the bias is added in float32 before the one rounding to the output dtype.

Grids and workspaces depend on shapes (stream-K's also on the device's SM count) only,
and nothing synchronises with the host: the launches can be captured in a CUDA graph. M
is not a specialisation key (do_not_specialize), so one compiled kernel serves every
batch size of a config. Triton's interpreter (TRITON_INTERPRET=1) runs them on the CPU
for the tests, fp16 only: its tl.dot on bf16 is wrong (tests/test_kernels_interpreter.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8          # weights and activations in e4m3

HALF = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMS = 132                 # the H200's SMs: default_config's splits (a shape rule, not a query)
REDUCE_BLOCK = 1024       # output columns per program of the split-K sum
MAX_SPLIT_BYTES = 0.25    # split-K partials may move at most this share of the weight bytes


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """One launch shape: BLOCK_M tokens × BLOCK_N output channels per program, BLOCK_K of
    K per step, K cut in SPLIT_K slices, and the layout (swap_ab: W as the MMA's A)."""
    BLOCK_M: int = 16
    BLOCK_N: int = 64
    BLOCK_K: int = 256
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True
    stream_k: bool = False   # persistent, one program per SM sharing out (tile, K step) runs
    fast_accum: bool = False  # FP8: wgmma's running sum never promoted (below); bf16 ignores it

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):   # tl.dot wants powers of two of at least 16
                raise ValueError(f"SkinnyConfig.{name} must be a power of two >= 16, not {v}")
        if self.SPLIT_K < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"SkinnyConfig: bad SPLIT_K / num_stages / num_warps in {self}")
        if self.stream_k and self.SPLIT_K != 1:
            raise ValueError(f"SkinnyConfig: stream-K cuts K itself, SPLIT_K must be 1 in {self}")

    @property
    def name(self) -> str:
        return (f"{'sab' if self.swap_ab else 'ab'} m{self.BLOCK_M} n{self.BLOCK_N} k{self.BLOCK_K} "
                f"{'streamk' if self.stream_k else f's{self.SPLIT_K}'} w{self.num_warps} st{self.num_stages}"
                f"{' fast' if self.fast_accum else ''}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SkinnyConfig:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def _c(swap, bm, bn, bk, split, warps, stages, stream_k=False, fast=False) -> SkinnyConfig:
    return SkinnyConfig(bm, bn, bk, split, warps, stages, swap, stream_k, fast)


# The device sweep's candidates, per operand kind. Tiles hold at most ~160 KB of shared
# memory over their stages (the H200 has 227 KB a block). FP8 takes the same tiles with
# twice the K per step: the same bytes in flight.
_HALF_CONFIGS = (
    # swap-AB, decode: 16 tokens on the MMA's N side, split-K for the narrow projections
    _c(True, 16, 64, 256, 1, 4, 4), _c(True, 16, 64, 256, 2, 4, 4), _c(True, 16, 64, 128, 4, 4, 4),
    _c(True, 16, 128, 128, 1, 4, 4),
    # swap-AB, 32-64 tokens
    _c(True, 32, 64, 256, 2, 4, 3), _c(True, 64, 64, 128, 1, 4, 4), _c(True, 64, 128, 128, 1, 8, 3),
    # swap-AB, 128-256 tokens in one or two tiles: each weight strip read once; at 200 tokens
    # qkv has 96 such strips of 64 rows for 132 SMs, so splits of 2 and 4 fill more of them
    _c(True, 128, 64, 128, 1, 4, 3), _c(True, 256, 64, 64, 1, 8, 4), _c(True, 256, 64, 64, 2, 8, 4),
    _c(True, 256, 64, 64, 4, 8, 4), _c(True, 256, 128, 64, 1, 8, 3),
    # no swap: mma.sync at 16 rows, wgmma from 64
    _c(False, 16, 64, 256, 1, 4, 4), _c(False, 64, 128, 64, 1, 4, 4), _c(False, 64, 128, 128, 2, 4, 3),
    _c(False, 128, 128, 64, 1, 8, 4),
    # stream-K: every SM busy whatever the tile count (qkv's 96 strips at 200 tokens, o's 64
    # at one token), each cut tile summed once by the fixup kernel
    _c(True, 16, 64, 256, 1, 4, 4, True), _c(True, 256, 64, 64, 1, 8, 4, True),
    _c(False, 128, 128, 64, 1, 8, 4, True),
)
_FP8_DROPPED = (_c(True, 16, 128, 128, 1, 4, 4), _c(True, 256, 128, 64, 1, 8, 3))
CONFIGS: dict[str, tuple[SkinnyConfig, ...]] = {
    "half": _HALF_CONFIGS,
    # the same tiles but two whose promoted FP8 sums serialise wgmma or spill (sm_90a,
    # ptxas), and three with the sums never promoted, to measure what the promotion costs
    "fp8": tuple(dataclasses.replace(c, BLOCK_K=2 * c.BLOCK_K) for c in _HALF_CONFIGS if c not in _FP8_DROPPED)
    + (_c(True, 16, 64, 512, 1, 4, 4, fast=True), _c(True, 256, 64, 128, 1, 8, 4, fast=True),
       _c(False, 128, 128, 128, 1, 8, 4, fast=True)),
}


def configs_for(dtype: torch.dtype) -> tuple[SkinnyConfig, ...]:
    """CONFIGS for the operands' dtype (bf16 / fp16, or e4m3)."""
    return CONFIGS["fp8" if dtype == FP8 else "half"]


def _split_k(M: int, N: int, K: int, cfg: SkinnyConfig, elt: int) -> int:
    """Double the split while under half the SMs have a program, every slice keeps four K
    steps (a full pipeline) and the partials stay under MAX_SPLIT_BYTES of the weights."""
    programs = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    steps = triton.cdiv(K, cfg.BLOCK_K)
    split = 1
    while (programs * split < SMS // 2 and steps >= 4 * 2 * split
           and 2 * (2 * split) * M * 4 <= MAX_SPLIT_BYTES * K * elt):   # per column: written, read back
        split *= 2
    return split


def default_config(M: int, N: int, K: int, dtype: torch.dtype) -> SkinnyConfig:
    """A first guess from the shape alone (the device sweep replaces it): swap-AB with the
    smallest token tile that holds M up to 64 tokens, wgmma-sized tiles above; split-K
    where the grid leaves most SMs idle. Its tiles are CONFIGS' (compiled for sm_90a in
    the tests), the split apart."""
    kb = 2 if dtype == FP8 else 1
    if M <= 64:
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        cfg = SkinnyConfig(bm, 64, (256 if bm <= 32 else 128) * kb, 1, 4, 3 if bm == 32 else 4, True)
    else:
        big = M > 128
        cfg = SkinnyConfig(128 if big else 64, 128, 64 * kb, 1, 8 if big else 4, 4, False)
    return dataclasses.replace(cfg, SPLIT_K=_split_k(M, N, K, cfg, 1 if dtype == FP8 else 2))


# --------------------------------------------------------------------------- kernels

@triton.jit
def _tile_product(x_ptr, w_ptr, xs_ptr, ws_ptr, M, N, K, k_lo, k_hi, pid_m, pid_n,
                  stride_xm, stride_wn, stride_xs, stride_ws,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, SCALED: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr):
    """One output tile's float32 product over K in [k_lo, k_hi) (k_lo a multiple of
    BLOCK_K), scaled: [BLOCK_N, BLOCK_M] (yᵀ) swap-AB, else [BLOCK_M, BLOCK_N]. PROMOTE
    (e4m3 operands): Hopper's FP8 wgmma keeps ~14 bits of its running sum (DeepSeek-V3
    report, 3.3.2), so the sum is added into the float32 accumulator every K step, as
    cuBLASLt does unless asked for fast accumulation."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = offs_m % M   # in bounds: loads need no row mask; the store drops the copies
    rows_n = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + rows_m.to(tl.int64)[None, :] * stride_xm + (k_lo + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_ok = k + offs_k < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
            if PROMOTE:
                acc = tl.dot(w, x, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if SCALED:
            acc = acc * tl.load(ws_ptr + rows_n * stride_ws)[:, None] * tl.load(xs_ptr + rows_m * stride_xs)[None, :]
    else:
        x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        w_ptrs = w_ptr + rows_n.to(tl.int64)[None, :] * stride_wn + (k_lo + offs_k)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = k + offs_k < K
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if PROMOTE:
                acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SCALED:
            acc = acc * tl.load(xs_ptr + rows_m * stride_xs)[:, None] * tl.load(ws_ptr + rows_n * stride_ws)[None, :]
    return acc


@triton.jit
def _tile_store(acc, y_ptr, b_ptr, M, N, pid_m, pid_n, stride_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc (_tile_product's layout) + bias, cast to y's dtype, stored where in bounds."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP_AB:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n % N).to(tl.float32)[:, None]
        out = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n % N).to(tl.float32)[None, :]
        out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, b_ptr, M, N, K, K_SPLIT,
                   stride_xm, stride_wn, stride_xs, stride_ws, stride_ym, stride_ys,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr):
    """Tile (pid_m, pid_n) over the K slice pid_s: into y, or into its float32 partials
    [split, M, N] (the bias then comes with the split-K sum: HAS_BIAS off here)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    k0 = pid_s * K_SPLIT
    acc = _tile_product(x_ptr, w_ptr, xs_ptr, ws_ptr, M, N, K, k0, tl.minimum(k0 + K_SPLIT, K), pid_m, pid_n,
                        stride_xm, stride_wn, stride_xs, stride_ws, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SCALED, SWAP_AB,
                        PROMOTE)
    _tile_store(acc, y_ptr + pid_s.to(tl.int64) * stride_ys, b_ptr, M, N, pid_m, pid_n, stride_ym,
                BLOCK_M, BLOCK_N, HAS_BIAS, SWAP_AB)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym,
                       SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[row, cols] = sum over splits, in split order (deterministic), + bias, cast."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + (s * M + row) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, b_ptr, p_ptr, M, N, K, TILES_M, STEPS, ITERS, PER_PROGRAM,
                     stride_xm, stride_wn, stride_xs, stride_ws, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr):
    """Persistent stream-K: the (tile, K step) iterations, tile-major, cut in equal runs of
    PER_PROGRAM, one run a program. A tile a program covers whole goes to y; the piece of
    a tile it starts inside (slot 0) or ends inside (slot 1) goes to its float32 partials,
    which _stream_k_fixup_kernel sums in program order."""
    pid = tl.program_id(0)
    it = pid * PER_PROGRAM
    end = tl.minimum(it + PER_PROGRAM, ITERS)
    if SWAP_AB:
        idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    else:
        idx = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while it < end:
        tile = it // STEPS
        s0 = it - tile * STEPS
        s1 = tl.minimum(STEPS, s0 + end - it)
        pid_m = tile % TILES_M
        pid_n = tile // TILES_M
        acc = _tile_product(x_ptr, w_ptr, xs_ptr, ws_ptr, M, N, K, s0 * BLOCK_K, tl.minimum(s1 * BLOCK_K, K),
                            pid_m, pid_n, stride_xm, stride_wn, stride_xs, stride_ws,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SCALED, SWAP_AB, PROMOTE)
        if (s0 == 0) & (s1 == STEPS):
            _tile_store(acc, y_ptr, b_ptr, M, N, pid_m, pid_n, stride_ym, BLOCK_M, BLOCK_N, HAS_BIAS, SWAP_AB)
        else:
            slot = tl.where(it == pid * PER_PROGRAM, 0, 1)
            tl.store(p_ptr + (pid * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + idx, acc)
        it += s1 - s0


@triton.jit(do_not_specialize=["M"])
def _stream_k_fixup_kernel(p_ptr, y_ptr, b_ptr, M, N, TILES_M, STEPS, PER_PROGRAM, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                           SWAP_AB: tl.constexpr):
    """Program q: the tile holding the boundary between runs q and q + 1, when the boundary
    cuts it and no earlier boundary does: its pieces summed in program order, + bias, cast."""
    b = (tl.program_id(0) + 1) * PER_PROGRAM
    tile = b // STEPS
    start = tile * STEPS
    if (b > start) & (b - PER_PROGRAM <= start):
        if SWAP_AB:
            idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            idx = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = start // PER_PROGRAM
        last = (start + STEPS - 1) // PER_PROGRAM
        for p in range(first, last + 1):
            slot = tl.where(p * PER_PROGRAM >= start, 0, 1)   # the run starts in this tile, or ends in it
            acc += tl.load(p_ptr + (p * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + idx)
        _tile_store(acc, y_ptr, b_ptr, M, N, tile % TILES_M, tile // TILES_M, stride_ym,
                    BLOCK_M, BLOCK_N, HAS_BIAS, SWAP_AB)


# --------------------------------------------------------------------------- wrappers

def _check_weight(x: torch.Tensor, w: torch.Tensor, what: str) -> tuple[int, int, int]:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{what}: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: x [M, K={x.shape[1]}] and w [N, K={w.shape[1]}] disagree on K")
    if x.device != w.device:
        raise ValueError(f"{what}: x on {x.device}, w on {w.device}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{what}: x and w must be contiguous along K (strides {x.stride()} and {w.stride()})")
    return x.shape[0], w.shape[0], x.shape[1]


def _check_out(out: torch.Tensor, M: int, N: int, dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != (M, N) or out.dtype != dtype or out.device != device or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{M}, {N}] {dtype} on {device} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")


def _check_vector(t: torch.Tensor, n: int, what: str, device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """t as a 1-D view of n elements (any stride, 0 included: a broadcast static scale)."""
    if t.numel() != n or t.device != device or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{what} must hold {n} {dtype or 'float'} values on {device}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return t.reshape(n) if t.dim() != 1 else t


def _launch(x, w, y, xs, ws, bias, cfg: SkinnyConfig, M: int, N: int, K: int) -> None:
    """The GEMM kernel (+ the split-K sum, or stream-K's fixup) into y [M, N]."""
    scaled = xs is not None
    ptrs = (x, w, y, xs if scaled else x, ws if scaled else x, bias if bias is not None else x)
    strides = (x.stride(0), w.stride(0), xs.stride(0) if scaled else 0, ws.stride(0) if scaled else 0)
    tiles = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SWAP_AB=cfg.swap_ab, HAS_BIAS=bias is not None)
    consts = dict(tiles, BLOCK_K=cfg.BLOCK_K, EVEN_K=K % cfg.BLOCK_K == 0, SCALED=scaled,
                  PROMOTE=scaled and not cfg.fast_accum, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.stream_k:
        tiles_m = triton.cdiv(M, cfg.BLOCK_M)
        steps = triton.cdiv(K, cfg.BLOCK_K)
        iters = tiles_m * triton.cdiv(N, cfg.BLOCK_N) * steps
        per = triton.cdiv(iters, min(_sm_count(x.device), iters))
        programs = triton.cdiv(iters, per)
        partial = torch.empty((programs, 2, cfg.BLOCK_M * cfg.BLOCK_N), dtype=torch.float32, device=x.device)
        _stream_k_kernel[(programs,)](*ptrs, partial, M, N, K, tiles_m, steps, iters, per, *strides, y.stride(0),
                                      **consts)
        if programs > 1:
            _stream_k_fixup_kernel[(programs - 1,)](partial, y, ptrs[5], M, N, tiles_m, steps, per, y.stride(0),
                                                    **tiles, num_warps=8)
        return
    k_split = triton.cdiv(triton.cdiv(K, cfg.BLOCK_K), cfg.SPLIT_K) * cfg.BLOCK_K
    split = triton.cdiv(K, k_split)   # a split left without K is dropped
    partial = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else y
    _skinny_kernel[(triton.cdiv(M, cfg.BLOCK_M), triton.cdiv(N, cfg.BLOCK_N), split)](
        *ptrs[:2], partial, *ptrs[3:], M, N, K, k_split, *strides, N if split > 1 else y.stride(0), M * N,
        **dict(consts, HAS_BIAS=bias is not None and split == 1))
    if split > 1:
        _sum_splits_kernel[(M, triton.cdiv(N, REDUCE_BLOCK))](
            partial, ptrs[5], y, M, N, y.stride(0), SPLITS=split, HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK, num_warps=4)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Stream-K's programs: one per SM (a property of the device, no synchronisation)."""
    if device.type != "cuda":
        return SMS   # Triton's interpreter: the H200's, as the GPU would cut the runs
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, *, cfg: SkinnyConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 / fp16 times w [N, K] (nn.Linear's weight: rows contiguous along K, a
    row stride above K allowed) -> y [M, N] in x's dtype, accumulated in float32.
    cfg: the launch (None: default_config); out: an [M, N] tensor to write instead."""
    M, N, K = _check_weight(x, w, "skinny_matmul")
    if x.dtype not in HALF or w.dtype != x.dtype:
        raise ValueError(f"skinny_matmul takes bf16 / fp16 x and w of one dtype, got {x.dtype} and {w.dtype}")
    if out is not None:
        _check_out(out, M, N, x.dtype, x.device)
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    _launch(x, w, y, None, None, None, cfg or default_config(M, N, K, x.dtype), M, N, K)
    return y


def skinny_matmul_fp8(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, *,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype,
                      cfg: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = (xq · wqᵀ) * x_scale[:, None] * w_scale[None, :] (+ bias) in out_dtype.

    xq e4m3 [M, K] with x_scale float32, one per token ([M, 1] as triton_fp8.quantize_tokens
    gives it, or [M]; a static scale broadcast with stride 0 works too); wq e4m3 [N, K]
    (Fp8Linear.weight) with w_scale float32 [N] (Fp8Linear.weight_scale, per-row); bias [N]
    in any float dtype, added in float32 before the rounding to out_dtype; cfg and out as
    skinny_matmul's."""
    M, N, K = _check_weight(xq, wq, "skinny_matmul_fp8")
    if xq.dtype != FP8 or wq.dtype != FP8:
        raise ValueError(f"skinny_matmul_fp8 takes float8_e4m3fn xq and wq, got {xq.dtype} and {wq.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"skinny_matmul_fp8: out_dtype must be one of {OUT_DTYPES}, not {out_dtype}")
    xs = _check_vector(x_scale, M, "x_scale", xq.device, torch.float32)
    ws = _check_vector(w_scale, N, "w_scale", xq.device, torch.float32)
    if bias is not None:
        bias = _check_vector(bias, N, "bias", xq.device)
        if not bias.is_floating_point() or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous float vector, got {bias.dtype} strides {bias.stride()}")
    if out is not None:
        _check_out(out, M, N, out_dtype, xq.device)
    y = out if out is not None else torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.float().expand(M, N))
    _launch(xq, wq, y, xs, ws, bias, cfg or default_config(M, N, K, FP8), M, N, K)
    return y

