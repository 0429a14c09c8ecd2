"""y += scale * (x A_iᵀ) B_iᵀ for each row with its adapter slot i (the scale is in B).

Two halves. The shrink, x A_iᵀ: for a plain projection it rides the base product (the A
slabs are extra rows of its weight, lora/slabs.py), so the product's tail columns hold
every slot's x A_sᵀ and `add_expand` only adds the expand; a quantized projection (whose
weight cannot carry them) and batch-1/2 steps on CUDA (which read one adapter's A, not
all of them) shrink on their own through `add_lora` (in decode-sized forwards beside the
base product, on a side stream: `add_lora_beside`).

On CUDA with the Triton kernels (engine/kernels/lora.py): tiled over the rows grouped by
slot so that each adapter's matrices are read once per tile, slot 0 (base rows) skipped.
Elsewhere the torch reference in float32 over the slabs gathered per row.
`ops.kernels_disabled({"lora"})` forces the reference (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model import ops
from ..kernels import CUDA_KERNELS
from .slabs import LoraBatch

KERNEL = "lora"   # the name ops.kernels_disabled() takes


def _kernels():
    if not CUDA_KERNELS or KERNEL in ops.DISABLED:   # no Triton here: no LoRA kernels either
        return None
    from ..kernels import lora

    return lora


def use_kernels(device: torch.device) -> bool:
    """Whether a forward on `device` runs the Triton kernels (they need rows grouped)."""
    return device.type == "cuda" and _kernels() is not None


def add_lora(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             segments: tuple[int, ...], batch: LoraBatch) -> torch.Tensor:
    """y plus the whole delta, shrink included (A [S, nseg*R, K])."""
    k = _kernels() if x.is_cuda and batch.groups is not None else None
    if k is not None:
        k.add_lora(y, x, A, B, segments, batch.groups)
        return y
    return lora_reference(y, x, A, B, segments, batch.idx)


def add_lora_beside(base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor, segments: tuple[int, ...], batch: LoraBatch) -> torch.Tensor:
    """base(x) plus the whole delta, computed on batch.side while the base product runs
    (CUDA, grouped rows, decode-sized forwards). Such a delta is a few short launches that
    would each wait for the device on their own: beside the product they run into a zeroed
    buffer that one add then joins (in a CUDA graph: a branch). H200, batch-1 with an
    adapter: 91.4-91.9 % of the base beside, 87.7 % after the product
    (docs/perf.md "Multi-LoRA")."""
    main = torch.cuda.current_stream(x.device)
    batch.side.wait_stream(main)
    with torch.cuda.stream(batch.side):
        d = torch.zeros(x.shape[0], sum(segments), dtype=B.dtype, device=x.device)
        _kernels().add_lora(d, x, A, B, segments, batch.groups)
    y = base(x)
    main.wait_stream(batch.side)
    return y.add_(d)


def add_expand(y: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
               batch: LoraBatch) -> torch.Tensor:
    """y plus the expand of every row's own slot from xa [T, S * nseg*R], every slot's
    shrink of every row (the base product's tail columns)."""
    k = _kernels() if xa.is_cuda and batch.groups is not None else None
    if k is not None:
        k.lora_expand_slots(y, xa, B, segments, batch.groups)
        return y
    S = B.shape[0]
    own = xa.reshape(xa.shape[0], S, -1)[torch.arange(xa.shape[0], device=xa.device), batch.idx.long()]
    return expand_reference(y, own, B, segments, batch.idx)


def expand_reference(y: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, segments: tuple[int, ...],
                     idx: torch.Tensor) -> torch.Tensor:
    """y + xa [T, nseg*R] (each row's shrink) times its slot's B, in float32 (slot 0's B
    is zero: a base row adds exactly nothing)."""
    R = B.shape[2]
    b = B.index_select(0, idx.long()).float()                                   # [T, out, R]
    xa = xa.float().unsqueeze(2)
    parts, n0 = [], 0
    for j, n in enumerate(segments):
        parts.append(torch.bmm(b[:, n0:n0 + n], xa[:, j * R:(j + 1) * R]).squeeze(2))
        n0 += n
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return (y.float() + delta).to(y.dtype)


def lora_reference(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   segments: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    """The delta in float32 over the slabs gathered per row (slot 0 adds zeros)."""
    xa = torch.bmm(A.index_select(0, idx.long()).float(), x.float().unsqueeze(2)).squeeze(2)   # [T, nseg*R]
    return expand_reference(y, xa, B, segments, idx)
