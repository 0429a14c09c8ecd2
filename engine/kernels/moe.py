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
depends on shapes only, so a CUDA graph can capture it. With SPLIT_K > 1 a second grid
axis splits K: each split writes its own float32 partial sums (no atomics), added up in
a fixed order afterwards, so the result is deterministic.

Tiles: a device's tuned table where one exists (moe_configs/<device name, spaces as _>.json,
written by gpu/moe_tune.py), keyed by GEMM shape (E, N, K) and token count; `_config`'s
defaults otherwise. The choice depends on shapes only, made on the host.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

from . import device_file

log = logging.getLogger("zerod.engine")

CHUNK = 128     # (token, expert) pairs per program of the count and scatter launches
TILE = 64       # chunks the offsets program reads at once
CONFIG_DIR = Path(__file__).with_name("moe_configs")


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


# n_pairs is only compared against: not specialised, so the token count never selects a variant
@triton.jit(do_not_specialize=["n_pairs"])
def _moe_gemm(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, total_ptr,
              N, K, K_SPLIT, n_pairs, stride_am, stride_be, stride_bn, stride_cm, stride_cs,
              TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """C[pair] = A[pair // TOP_K] @ B[expert]ᵀ (x the pair's routing weight); with SPLIT_K > 1,
    program (., s) sums K's s-th slice of K_SPLIT (a multiple of BLOCK_K) into C[s]."""
    pid = tl.program_id(0)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks_n
    pid_n = pid % n_blocks_n
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        c_ptr += tl.program_id(1).to(tl.int64) * stride_cs
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + (k_lo + offs_k)[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + (k_lo + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_in = offs_k < K - k0     # a slice ends on a BLOCK_K boundary: only K's end is ragged
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


# --------------------------------------------------------------------------- tuned tables

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
SPLIT_MAX = 16
_SHAPE_KEY = re.compile(r"E=(\d+),N=(\d+),K=(\d+)")


def shape_key(e: int, n: int, k: int) -> str:
    """A table's key for the GEMM of weights [e, n, k]."""
    return f"E={e},N={n},K={k}"


@dataclass(frozen=True)
class Table:
    """One device's tuned tiles: per GEMM shape (E, N, K), the token counts measured
    (ascending) and the config of each."""
    dtype: str
    shapes: dict

    def pick(self, e: int, n: int, k: int, t: int, dtype: torch.dtype) -> dict | None:
        """The config of the smallest measured count at or above t (the largest where t is
        past them all); None where the weights' dtype or the shape is not in the table."""
        entry = self.shapes.get((e, n, k))
        if entry is None or str(dtype).removeprefix("torch.") != self.dtype:
            return None
        ts, cfgs = entry
        return dict(cfgs[min(bisect.bisect_left(ts, t), len(ts) - 1)])


NO_TABLE = Table("", {})    # `_config`'s defaults everywhere


def _pow2(v) -> bool:
    return type(v) is int and 16 <= v <= 256 and v & (v - 1) == 0


def check_config(cfg) -> str | None:
    """Why cfg cannot be a tile config (None: it can)."""
    if not isinstance(cfg, dict):
        return "not an object"
    keys = set(cfg)
    if not set(TILE_KEYS) <= keys <= set(TILE_KEYS) | {"SPLIT_K"}:
        return f"keys {sorted(keys)}: want {', '.join(TILE_KEYS)} (and SPLIT_K)"
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if not _pow2(cfg[name]):
            return f"{name} {cfg[name]!r} is not a power of two in 16..256"
    if cfg["num_warps"] not in (1, 2, 4, 8, 16) or type(cfg["num_warps"]) is not int:
        return f"num_warps {cfg['num_warps']!r} is not 1, 2, 4, 8 or 16"
    if type(cfg["num_stages"]) is not int or not 1 <= cfg["num_stages"] <= 8:
        return f"num_stages {cfg['num_stages']!r} is not in 1..8"
    split = cfg.get("SPLIT_K", 1)
    if type(split) is not int or not 1 <= split <= SPLIT_MAX:
        return f"SPLIT_K {split!r} is not in 1..{SPLIT_MAX}"
    return None


def parse_table(doc, where: str) -> Table:
    """A Table from a table file's JSON ({"dtype", "configs": {shape_key: {T: config}}};
    other keys are the tuner's and ignored); ValueError naming `where` and the entry."""
    if not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict) or not isinstance(doc.get("dtype"), str):
        raise ValueError(f"{where}: want an object with \"dtype\" and \"configs\"")
    shapes = {}
    for key, per_t in doc["configs"].items():
        m = _SHAPE_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"{where}: shape {key!r} is not E=..,N=..,K=..")
        if not isinstance(per_t, dict) or not per_t:
            raise ValueError(f"{where}: {key}: want a non-empty object of token counts")
        rows = []
        for t, cfg in per_t.items():
            if not (isinstance(t, str) and t.isdigit() and int(t) > 0):
                raise ValueError(f"{where}: {key}: token count {t!r} is not a positive integer")
            why = check_config(cfg)
            if why:
                raise ValueError(f"{where}: {key} T={t}: {why}")
            rows.append((int(t), dict(cfg)))
        rows.sort(key=lambda r: r[0])
        shapes[tuple(int(g) for g in m.groups())] = ([t for t, _ in rows], [c for _, c in rows])
    return Table(doc["dtype"], shapes)


def load_table(path: Path) -> Table:
    """parse_table of a file; OSError or ValueError where it cannot be read or is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    return parse_table(doc, str(path))


def table_path(device_name: str) -> Path:
    return device_file(CONFIG_DIR, device_name)


_TABLES: dict = {}   # (device type, index) -> Table, once a process


def device_table(device: torch.device) -> Table:
    """The tuned table of this device's model, NO_TABLE where there is none; a file that
    cannot be used is logged once and ignored (serving keeps the defaults)."""
    key = (device.type, device.index)
    table = _TABLES.get(key)
    if table is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        path = table_path(name)
        table = NO_TABLE
        if path.is_file():
            try:
                table = load_table(path)
            except (OSError, ValueError) as e:
                log.warning("MoE tile table ignored, default tiles used: %s", e)
        _TABLES[key] = table
    return table


def _config(pairs_per_expert: float, n_out: int) -> dict:
    """Default tile sizes: decode-sized batches stream the weights (short M, wide K);
    prefill batches are compute-bound tiles."""
    if pairs_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64 if n_out >= 8192 else 32, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


def tiles(w: torch.Tensor, t: int, top_k: int, table: Table) -> dict:
    """The config of the GEMM against weights w [E, N, K] for t tokens."""
    e, n, k = w.shape
    return table.pick(e, n, k, t, w.dtype) or _config(t * top_k / e, n)


# --------------------------------------------------------------------------- the experts

def k_slice(k_dim: int, split: int, block_k: int) -> int:
    """The K each split sums: a 1/split share rounded up to whole BLOCK_K steps."""
    return triton.cdiv(triton.cdiv(k_dim, split), block_k) * block_k


def _gemm(a, b, weights, sorted_ids, expert_ids, total, top_k: int, cfg: dict, n_pairs: int,
          warmup: bool = False) -> torch.Tensor:
    """[n_pairs, N] in a's dtype; with cfg's SPLIT_K > 1, [SPLIT_K, n_pairs, N] float32 partial
    sums. warmup: compile only (Triton's warmup: same specialisation, nothing launched)."""
    e, n_out, k_dim = b.shape
    split = cfg.get("SPLIT_K", 1)
    c = torch.empty((split, n_pairs, n_out), dtype=torch.float32 if split > 1 else a.dtype, device=a.device)
    k_split = k_slice(k_dim, split, cfg["BLOCK_K"])
    grid = (sorted_ids.numel() // cfg["BLOCK_M"] * triton.cdiv(n_out, cfg["BLOCK_N"]), split)
    args = (a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, total,
            n_out, k_dim, k_split, n_pairs, a.stride(0), b.stride(0), b.stride(1), c.stride(1), c.stride(0))
    consts = dict(cfg, SPLIT_K=split, TOP_K=top_k, MUL_WEIGHT=weights is not None,
                  PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
    if warmup:
        _moe_gemm.warmup(*args, grid=grid, **consts)
    else:
        _moe_gemm[grid](*args, **consts)
    return c if split > 1 else c[0]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                  table: Table | None = None) -> torch.Tensor:
    """sum over the k experts of token t: weight * w2[e] @ act(w13[e] @ x[t]).
    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights float32 [T, k]; topk_ids [T, k].
    table: the tiles to use (default: the device's tuned table)."""
    t = x.shape[0]
    e = w13.shape[0]
    k = topk_ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    table = device_table(x.device) if table is None else table
    cfg13 = tiles(w13, t, k, table)
    # one alignment serves both GEMMs, so w2 runs at w13's BLOCK_M (the tuner picks one
    # BLOCK_M per token count for the pair: a second alignment would cost three launches)
    cfg2 = dict(tiles(w2, t, k, table), BLOCK_M=cfg13["BLOCK_M"])
    sorted_ids, expert_ids, total = align(topk_ids, e, cfg13["BLOCK_M"])
    inter = _gemm(x, w13, None, sorted_ids, expert_ids, total, k, cfg13, t * k)
    if inter.dim() == 3:
        inter = inter.sum(dim=0).to(x.dtype)
    a2 = act(inter).contiguous()
    out = _gemm(a2, w2, topk_weights.reshape(-1).float().contiguous(), sorted_ids, expert_ids, total, 1,
                cfg2, t * k)
    return sum_pairs(out, t, k, x.dtype)


@triton.jit
def _sum_pairs_kernel(x_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


SUM_BLOCK = 1024


def sum_pairs(out: torch.Tensor, t: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[t, H]: the k pairs of each token added up, from w2's output [t * k, H] (or split-K's
    float32 partials [S, t * k, H], added up with them in float32). The 2-D case is one
    Triton launch summing in float32, bitwise torch's sum for k = 2, where torch's sum over
    the middle dimension is a slower strided reduction (docs/perf.md "Kernels")."""
    if out.dim() == 3:
        return out.view(-1, t, k, out.shape[-1]).sum(dim=(0, 2)).to(dtype)
    h = out.shape[-1]
    res = torch.empty((t, h), dtype=out.dtype, device=out.device)
    _sum_pairs_kernel[(t, triton.cdiv(h, SUM_BLOCK))](out, res, h, TOP_K=k, BLOCK=SUM_BLOCK, num_warps=4)
    return res
