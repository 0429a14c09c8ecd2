"""y += scale * (x A_iᵀ) B_iᵀ for each row with its adapter slot i (the scale is in B).

On CUDA with the Triton kernels (engine/kernels/lora.py): tiled over the rows grouped by
slot so that each adapter's matrices are read once per tile, slot 0 (base rows) skipped;
for a batch-1 step one launch per projection split over K, a shrink and an expand for
more rows (in decode-sized forwards `add_lora_beside` starts them on a side stream beside
the base product). Elsewhere the torch reference: one bmm over the gathered slabs per half.
`ops.kernels_disabled({"lora"})` forces the reference (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
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
    k = _kernels() if x.is_cuda and batch.groups is not None else None
    if k is not None:
        k.add_lora(y, x, A, B, segments, batch.groups)
        return y
    return lora_reference(y, x, A, B, segments, batch.idx)


def add_lora_beside(base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor, segments: tuple[int, ...], batch: LoraBatch) -> torch.Tensor:
    """base(x) plus the delta, computed on batch.side while the base product runs (CUDA,
    grouped rows). A decode-sized delta is a few short launches that would each wait for
    the device on their own: beside the product they run into a zeroed buffer that one
    add then joins (in a CUDA graph: a branch). Only the shrink beside and the expand in
    place after the product was no faster (H200: 2.8 vs 2.5 ms a 200-row step, the same
    at 2-64 rows; gpu/results/lora/2026-12-01-overlap/)."""
    main = torch.cuda.current_stream(x.device)
    batch.side.wait_stream(main)
    with torch.cuda.stream(batch.side):
        d = torch.zeros(x.shape[0], sum(segments), dtype=B.dtype, device=x.device)
        _kernels().add_lora(d, x, A, B, segments, batch.groups)
    y = base(x)
    main.wait_stream(batch.side)
    return y.add_(d)


def lora_reference(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   segments: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    """The delta in float32 over the slabs gathered per row (slot 0 adds zeros)."""
    idx = idx.long()
    R = B.shape[2]
    xa = torch.bmm(A.index_select(0, idx).float(), x.float().unsqueeze(2))    # [T, nseg*R, 1]
    b = B.index_select(0, idx).float()                                          # [T, out, R]
    parts, n0 = [], 0
    for j, n in enumerate(segments):
        parts.append(torch.bmm(b[:, n0:n0 + n], xa[:, j * R:(j + 1) * R]).squeeze(2))
        n0 += n
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return (y.float() + delta).to(y.dtype)
