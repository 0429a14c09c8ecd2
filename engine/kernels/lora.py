"""Multi-LoRA: y[t] += (x[t] A_sᵀ) B_sᵀ with s the adapter slot of row t.

Rows are grouped by slot once per forward (`group_rows`, one launch): `order` lists the
rows slot by slot and `tiles` lists the (slot, first row) of every BLOCK_M-row tile of
one adapter, so a program reads its adapter's matrices once per tile (tl.dot), not once
per row. The grids have min(T, T/BLOCK_M + slots) row tiles, not slots x T/BLOCK_M: a
decode step of 200 rows over 8 adapters launches ~21 row tiles, not 104 mostly empty
ones. Slot 0 ("no adapter") has no tile: base rows in a mixed batch cost nothing here.
Every grid is fixed by shapes and nothing syncs with the host: the kernels are captured
in the decode CUDA graphs. The ints that vary with a step's rows (T, tiles, splits) are
not specialised on: a prefill of a row count the warm-up did not run compiles nothing
(the H200 showed 0.7-1.8 s compiles at the first 700-token mixed-adapter step).

Two paths, by the number of rows T (the projection's segments are fused in all):
- T <= FUSED_MAX_ROWS (decode): the ways of DECODE, timed by gpu/lora_kernels_bench.py
  (H200, docs/perf.md "Multi-LoRA"): splitk-atomic is fastest at 1 and 2 rows,
  two-launch at 4 and 16 rows (8 adapters); each program walking all of K alone is
  fastest nowhere (1.9 ms a batch-1 step against split-K's 0.7). add_lora takes splitk-atomic up to SPLITK_MAX_ROWS rows and
  two-launch above.
  "splitk-atomic": ONE launch, grid (row tiles, column tiles, K splits). Each
    program computes its rows' x A_segᵀ over its K chunk only, times B_segᵀ of its
    column tile, and atomically adds that into y (the delta is linear in the K chunks).
    A batch-1 step is latency bound: this fills the GPU (~TARGET_PROGRAMS programs) with
    short programs (<= MAX_CHUNK of K each) for one launch, paying the re-reads of each A
    chunk per column tile from L2 (~5-9 MB a product at the 8B shape).
  "two-launch": the shrink and expand below (A and B read once each, two launches).
- larger T (prefill, big batches): a shrink, split over K so that few rows still fill
  the GPU, writes float32 partials [splits, T, R]; the expand sums them as it reads
  them (no reduction launch) and adds into y in place.
A plain projection above SPLITK_MAX_ROWS rows needs no shrink kernel: its product carries
every slot's shrink in its tail columns (engine/lora/slabs.py), and `lora_expand_slots`
reads each row's own slot from there (the same expand kernel, one "partial", a column
offset per slot). H200, a 200-row decode step over 8 adapters: +1,197 µs against +2,977
with the shrink kernel (docs/perf.md "Multi-LoRA").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

FUSED_MAX_ROWS = 16
DECODE_MAX_ROWS = 256   # the largest decode graph: up to it, the big-decode tiling below (measured at 64, 200)
SPLITK_MAX_ROWS = 2     # the rows up to which add_lora takes splitk-atomic (measured: above)
OVERLAP_MAX_ROWS = DECODE_MAX_ROWS   # forwards whose own-shrink deltas run beside the base products (lora/slabs.py)
DECODE_BLOCK_M = 16     # rows per tile up to DECODE_MAX_ROWS (32 speeds the shrink, slows the expand more)
TARGET_PROGRAMS = 256   # splitk-atomic, the prefill shrink: ~2 programs an SM of an H200 (132 SMs)
MIN_CHUNK = 512         # ... K per split at least (each split rounds its partial into y)
MAX_CHUNK = 2048        # ... and at most (a program's serial K steps)


class Groups(NamedTuple):
    """The rows of a forward grouped by adapter slot (made by group_rows)."""
    order: torch.Tensor    # int32 [T]: the rows, slot by slot, each slot's in row order
    starts: torch.Tensor   # int32 [S]: index in `order` of each slot's first row
    counts: torch.Tensor   # int32 [S]: rows of each slot
    tiles: torch.Tensor    # int32 [2, NT]: slot (0: no tile) and first row in the slot
    block_m: int           # rows per tile


def block_m(T: int) -> int:
    return 16 if T <= FUSED_MAX_ROWS else DECODE_BLOCK_M if T <= DECODE_MAX_ROWS else 64


def num_tiles(T: int, S: int, bm: int) -> int:
    """An upper bound on the tiles of T rows over slots 1..S-1 (each slot: ceil(n / bm))."""
    return min(T, triton.cdiv(T, bm) + S - 1)


@triton.jit(do_not_specialize=["T", "S", "NT"])
def _group_kernel(idx_ptr, order_ptr, starts_ptr, counts_ptr, tiles_ptr, T, S, NT,
                  BM: tl.constexpr, BLOCK: tl.constexpr):
    # one program: a stable counting sort by slot, then the tile table
    start = tl.full((), 0, tl.int32)
    tile = tl.full((), 0, tl.int32)
    for s in range(0, S):
        n = tl.full((), 0, tl.int32)
        for t0 in range(0, T, BLOCK):
            offs = t0 + tl.arange(0, BLOCK)
            v = tl.load(idx_ptr + offs, mask=offs < T, other=-1)
            hit = (v == s).to(tl.int32)
            pos = start + n + tl.cumsum(hit, 0) - 1
            tl.store(order_ptr + pos, offs, mask=hit > 0)
            n += tl.sum(hit, 0)
        tl.store(starts_ptr + s, start)
        tl.store(counts_ptr + s, n)
        if s > 0:
            nt = (n + BM - 1) // BM
            for i0 in range(0, nt, BLOCK):
                i = i0 + tl.arange(0, BLOCK)
                tl.store(tiles_ptr + tile + i, tl.full((BLOCK,), 0, tl.int32) + s, mask=i < nt)
                tl.store(tiles_ptr + NT + tile + i, i * BM, mask=i < nt)
            tile += nt
        start += n
    for i0 in range(0, NT, BLOCK):   # the grid's tiles past the last one: no slot
        i = i0 + tl.arange(0, BLOCK)
        pad = (i >= tile) & (i < NT)
        tl.store(tiles_ptr + i, tl.zeros((BLOCK,), tl.int32), mask=pad)
        tl.store(tiles_ptr + NT + i, tl.zeros((BLOCK,), tl.int32), mask=pad)


def group_rows(idx: torch.Tensor, num_slots: int) -> Groups:
    """idx int32 [T] (each row's slot) -> Groups; one launch, no host sync."""
    T = idx.shape[0]
    bm = block_m(T)
    nt = num_tiles(T, num_slots, bm)
    dev = idx.device
    order = torch.empty(T, dtype=torch.int32, device=dev)
    starts = torch.empty(num_slots, dtype=torch.int32, device=dev)
    counts = torch.empty(num_slots, dtype=torch.int32, device=dev)
    tiles = torch.empty(2, nt, dtype=torch.int32, device=dev)
    if T:
        _group_kernel[(1,)](idx, order, starts, counts, tiles, T, num_slots, nt,
                            BM=bm, BLOCK=1024, num_warps=4)
    return Groups(order, starts, counts, tiles, bm)


@triton.jit
def _tile_rows(tiles_ptr, NT, order_ptr, starts_ptr, counts_ptr, BM: tl.constexpr):
    """The slot of row tile program_id(0) (0: none) and its rows (int64) with their mask."""
    t = tl.program_id(0)
    s = tl.load(tiles_ptr + t)
    m0 = tl.load(tiles_ptr + NT + t)
    offs_m = m0 + tl.arange(0, BM)
    mask_m = offs_m < tl.load(counts_ptr + s)
    rows = tl.load(order_ptr + tl.load(starts_ptr + s) + offs_m, mask=mask_m, other=0).to(tl.int64)
    return s, rows, mask_m


@triton.jit
def _segment_cols(tile, n1, n2, n3, t1, t2, BN: tl.constexpr):
    """Output segment of column tile `tile` (t1, t2: tiles of segments 1 and 2), its
    columns in y and their mask."""
    seg = (tile >= t1).to(tl.int32) + (tile >= t1 + t2).to(tl.int32)
    seg_n0 = tl.where(seg == 0, 0, tl.where(seg == 1, n1, n1 + n2))
    seg_n = tl.where(seg == 0, n1, tl.where(seg == 1, n2, n3))
    seg_t0 = tl.where(seg == 0, 0, tl.where(seg == 1, t1, t1 + t2))
    offs_n = (tile - seg_t0) * BN + tl.arange(0, BN)
    return seg, seg_n0 + offs_n, offs_n < seg_n


@triton.jit
def _load_bt(b_ptr, stride_bn, s, cols, mask_n, rank, stride_bs, BR: tl.constexpr):
    """B_s[cols]ᵀ [BR, BN] (rows past the rank: zeros)."""
    offs_r = tl.arange(0, BR)
    return tl.load(b_ptr + s.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None],
                   mask=mask_n[None, :] & (offs_r[:, None] < rank), other=0.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _add_expand(y_ptr, stride_yt, b_ptr, stride_bn, xa, s, rows, mask_m, cols, mask_n,
                rank, stride_bs, BR: tl.constexpr, IEEE: tl.constexpr):
    """y[rows, cols] += xa [BM, BR] (float32) B_s[cols]ᵀ."""
    bt = _load_bt(b_ptr, stride_bn, s, cols, mask_n, rank, stride_bs, BR)
    d = _dot(xa.to(bt.dtype), bt, IEEE)
    ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + d).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _xa(x_ptr, stride_xt, rows, mask_m, a_rows, r_lim, k_lo, k_hi, K,
        BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """x[rows, k_lo:k_hi] A[:, k_lo:k_hi]ᵀ in float32 [BM, BR]; a_rows [1, BR]: pointers to
    A's rank rows at k = 0 (rows from r_lim on read as zero)."""
    offs_r = tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None], mask=(offs_r[None, :] < r_lim) & mask_k[:, None], other=0.0)
        acc += _dot(xt, at, IEEE)
    return acc


@triton.jit(do_not_specialize=["NT"])
def _splitk_kernel(y_ptr, x_ptr, a_ptr, b_ptr, order_ptr, starts_ptr, counts_ptr, tiles_ptr,
                   NT, K, k_per_split, n1, n2, n3, t1, t2, rank,
                   stride_yt, stride_xt, stride_as, stride_ar, stride_bs, stride_bn,
                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr):
    s, rows, mask_m = _tile_rows(tiles_ptr, NT, order_ptr, starts_ptr, counts_ptr, BM)
    if s == 0:
        return
    seg, cols, mask_n = _segment_cols(tl.program_id(1), n1, n2, n3, t1, t2, BN)
    bt = _load_bt(b_ptr, stride_bn, s, cols, mask_n, rank, stride_bs, BR)   # first: overlaps the K loop
    a_rows = a_ptr + s.to(tl.int64) * stride_as + (seg * rank + tl.arange(0, BR)[None, :]) * stride_ar
    k_lo = tl.program_id(2) * k_per_split
    acc = _xa(x_ptr, stride_xt, rows, mask_m, a_rows, rank, k_lo, k_lo + k_per_split, K, BM, BR, BK, IEEE)
    d = _dot(acc.to(bt.dtype), bt, IEEE)
    # the splits add in whatever order they finish: in bf16/fp16 each partial is rounded
    # into y on its own, so y's last bits differ from run to run (not bit-reproducible)
    tl.atomic_add(y_ptr + rows[:, None] * stride_yt + cols[None, :], d,
                  mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")


@triton.jit(do_not_specialize=["NT", "T", "k_per_split"])
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, tiles_ptr,
                   NT, T, K, R, k_per_split,
                   stride_xt, stride_as, stride_ar, stride_ot,
                   BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    s, rows, mask_m = _tile_rows(tiles_ptr, NT, order_ptr, starts_ptr, counts_ptr, BM)
    if s == 0:
        return
    split = tl.program_id(1)
    offs_r = tl.arange(0, BR)
    mask_r = offs_r < R
    k_lo = split * k_per_split
    a_rows = a_ptr + s.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    acc = _xa(x_ptr, stride_xt, rows, mask_m, a_rows, R, k_lo, k_lo + k_per_split, K, BM, BR, BK, IEEE)
    out = out_ptr + split.to(tl.int64) * T * stride_ot
    tl.store(out + rows[:, None] * stride_ot + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["NT", "splits"])
def _expand_kernel(y_ptr, xa_ptr, b_ptr, order_ptr, starts_ptr, counts_ptr, tiles_ptr,
                   NT, splits, n1, n2, n3, t1, t2, rank,
                   stride_yt, stride_xsp, stride_xt, stride_xs, stride_bs, stride_bn,
                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr,
                   IEEE: tl.constexpr):
    # xa of row t, slot s, segment j: sum over sp < splits of
    # xa_ptr[sp * stride_xsp + t * stride_xt + s * stride_xs + j * rank + r]
    s, rows, mask_m = _tile_rows(tiles_ptr, NT, order_ptr, starts_ptr, counts_ptr, BM)
    if s == 0:
        return
    seg, cols, mask_n = _segment_cols(tl.program_id(1), n1, n2, n3, t1, t2, BN)
    offs_r = tl.arange(0, BR)
    offs_sp = tl.arange(0, SB)
    ptrs = (xa_ptr + rows[None, :, None] * stride_xt + s.to(tl.int64) * stride_xs + seg * rank
            + offs_r[None, None, :] + offs_sp[:, None, None].to(tl.int64) * stride_xsp)
    mask = mask_m[None, :, None] & (offs_r[None, None, :] < rank)
    xa = tl.zeros((BM, BR), dtype=tl.float32)
    for sp0 in range(0, splits, SB):   # the shrink's K splits, SB of them a load, summed here
        sp_mask = (sp0 + offs_sp[:, None, None]) < splits
        xa += tl.sum(tl.load(ptrs + sp0 * stride_xsp, mask=mask & sp_mask, other=0.0).to(tl.float32), axis=0)
    _add_expand(y_ptr, stride_yt, b_ptr, stride_bn, xa, s, rows, mask_m, cols, mask_n,
                rank, stride_bs, BR, IEEE)


@functools.lru_cache(maxsize=None)
def _col_tiles(segments: tuple[int, ...], bn: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the three segment sizes, 0-padded; their column tiles of bn)."""
    assert len(segments) <= 3
    n = tuple(segments) + (0,) * (3 - len(segments))
    return n, tuple(triton.cdiv(v, bn) for v in n)


# split-K's column tile for wide projections: gpu/lora_kernels_bench.py's sweep on the H200
# (8B shape, rank 16, 1-2 rows) puts 512 first at both, ~100 µs a decode step under 256
# (docs/perf.md "Multi-LoRA").
SPLITK_BN = 512


@functools.lru_cache(maxsize=None)
def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _decode_grid(y: torch.Tensor, x: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
                 g: Groups, bn: int | None = None) -> tuple[torch.Tensor, int, list[int], list[int]] | None:
    """A decode way's launch shape: (x contiguous in K, column tile (None: by N), segment
    sizes, column tiles per segment); None when no row has an adapter slot to add."""
    if not g.tiles.shape[1] or B.shape[0] == 1:
        return None
    assert y.stride(-1) == 1
    bn = bn or (SPLITK_BN if B.shape[1] >= 4096 else 64)
    n, tiles = _col_tiles(segments, bn)
    return (x if x.stride(-1) == 1 else x.contiguous()), bn, n, tiles


def splitk_splits(K: int, programs: int) -> int:
    """K splits for splitk-atomic with `programs` (row tiles x column tiles) per split:
    about TARGET_PROGRAMS in all, each split's chunk within [MIN_CHUNK, MAX_CHUNK] of K
    where K allows (a chunk is never cut below MIN_CHUNK to reach the target)."""
    fill = max(1, round(TARGET_PROGRAMS / programs))
    return max(1, min(fill, K // MIN_CHUNK), triton.cdiv(K, MAX_CHUNK))


def lora_splitk(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                segments: tuple[int, ...], g: Groups, splits: int | None = None,
                bn: int | None = None) -> None:
    """y [T, N] += per segment j: x A[slot, j*Rmax:(j+1)*Rmax]ᵀ B[slot, segment j]ᵀ in one
    launch, with K split `splits` ways (None: splitk_splits) and each split's delta added
    into y atomically; bn the column tile (None: _decode_grid's).
    y must be float32, float16 or bfloat16."""
    if (grid := _decode_grid(y, x, B, segments, g, bn)) is None:
        return
    x, bn, n, tiles = grid
    nt, K, rank = g.tiles.shape[1], x.shape[1], B.shape[2]
    splits = splits or splitk_splits(K, nt * sum(tiles))
    chunk = triton.cdiv(K, splits)
    bk = min(256, max(16, triton.next_power_of_2(chunk)))
    k_per_split = triton.cdiv(chunk, bk) * bk
    _splitk_kernel[(nt, sum(tiles), triton.cdiv(K, k_per_split))](
        y, x, A, B, g.order, g.starts, g.counts, g.tiles, nt, K, k_per_split,
        n[0], n[1], n[2], tiles[0], tiles[1], rank,
        y.stride(0), x.stride(0), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
        BM=g.block_m, BN=bn, BR=_block_r(rank), BK=bk, IEEE=y.dtype == torch.float32, num_warps=4)


def shrink_splits(T: int, K: int, tiles: int) -> int:
    """The shrink's K splits: enough that a step with a few rows per adapter still fills
    the GPU (H200: at a 200-row decode step 16 splits make two-launch's extra 1.9 ms a
    step against 2.2 with the 10 of 2048 // T). Above decode sizes, splits until the row
    tiles make ~TARGET_PROGRAMS programs: a 1,000-token prefill over 8 adapters has ~23
    tiles of 64 rows, and 2048 // T splits would run it on a third of the SMs, each program
    walking half of K (H200: the shrink 2.5-5.2x faster per prefill forward with these
    splits; docs/perf.md "Multi-LoRA"). Each split keeps >= 256 of K. The expand re-reads
    every split's partials per column tile, so more splits cost it more; that side is not
    timed against 2048 // T."""
    if T <= DECODE_MAX_ROWS:
        return max(1, min(32, K // 256, max(2048 // max(T, 1), 16)))
    return max(1, min(32, K // 256, triton.cdiv(TARGET_PROGRAMS, max(tiles, 1))))


def lora_shrink(x: torch.Tensor, A: torch.Tensor, g: Groups, splits: int | None = None) -> torch.Tensor:
    """x [T, K], A [S, R, K] -> partial sums [splits, T, R] float32 of x A_slotᵀ over K
    (rows of slot 0: undefined, never read). splits: None picks them by T."""
    T, K = x.shape
    S, R, _ = A.shape
    nt = g.tiles.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    bk = 64
    splits = splits or shrink_splits(T, K, nt)
    k_per_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty(splits, T, R, dtype=torch.float32, device=x.device)
    if nt and S > 1:
        _shrink_kernel[(nt, splits)](
            x, A, part, g.order, g.starts, g.counts, g.tiles, nt, T, K, R, k_per_split,
            x.stride(0), A.stride(0), A.stride(1), part.stride(1),
            BM=g.block_m, BR=_block_r(R), BK=bk, IEEE=x.dtype == torch.float32, num_warps=4)
    return part


def expand_bn(T: int) -> int:
    """The expand's column tile: 256 for big decode steps (H200, 8 adapters: the fastest at
    64 and 200 rows, 11-24 % less than 128), 128 elsewhere. Alone, prefill-sized expands
    (512-4,800 rows) ran 29-44 % faster at 256 columns with 8 warps, but a server with that
    rule measures no better at 200 streams (docs/perf.md "Multi-LoRA"), so 128 stays."""
    return 256 if FUSED_MAX_ROWS < T <= DECODE_MAX_ROWS else 128


def lora_expand(y: torch.Tensor, part: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
                g: Groups, bn: int | None = None, warps: int = 4) -> None:
    """y [T, N] += per segment j: xa[:, j*Rmax:(j+1)*Rmax] B[slot, segment j]ᵀ in place,
    xa the sum of lora_shrink's partials [splits, T, nseg*Rmax]."""
    assert part.is_contiguous()
    _expand(y, part, part.shape[0], part.stride(0), part.stride(1), 0, B, segments, g, bn, warps)


def lora_expand_slots(y: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
                      g: Groups, bn: int | None = None) -> None:
    """The same from every slot's shrink of every row, xa [T, S * nseg*Rmax] (any row
    stride: the tail columns of a product that carried the A slabs, lora/slabs.py): row
    t reads its own slot's columns."""
    assert xa.stride(-1) == 1
    _expand(y, xa, 1, 0, xa.stride(0), xa.shape[1] // B.shape[0], B, segments, g, bn, 4)


def _expand(y, xa, splits, stride_xsp, stride_xt, stride_xs, B, segments, g, bn, warps) -> None:
    S, N, rank = B.shape
    nt = g.tiles.shape[1]
    if not nt or S == 1:
        return
    assert y.stride(-1) == 1
    bn = bn or expand_bn(y.shape[0])
    n, tiles = _col_tiles(segments, bn)
    _expand_kernel[(nt, sum(tiles))](
        y, xa, B, g.order, g.starts, g.counts, g.tiles, nt, splits,
        n[0], n[1], n[2], tiles[0], tiles[1], rank,
        y.stride(0), stride_xsp, stride_xt, stride_xs, B.stride(0), B.stride(1),
        BM=g.block_m, BN=bn, BR=_block_r(rank), SB=8 if splits > 1 else 1,
        IEEE=y.dtype == torch.float32, num_warps=warps)


def lora_two_launch(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    segments: tuple[int, ...], g: Groups) -> None:
    """y += the delta by lora_shrink then lora_expand."""
    lora_expand(y, lora_shrink(x, A, g), B, segments, g)


DECODE = {"splitk-atomic": lora_splitk, "two-launch": lora_two_launch}


def add_lora(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             segments: tuple[int, ...], g: Groups) -> None:
    """y += the LoRA delta of each row's adapter, in place."""
    if x.shape[0] <= SPLITK_MAX_ROWS:
        lora_splitk(y, x, A, B, segments, g)
    else:
        lora_two_launch(y, x, A, B, segments, g)
