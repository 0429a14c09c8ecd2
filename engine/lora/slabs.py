"""The fixed device buffers adapters live in, and the adapter of each row of a forward.

Per projection of every layer: A [max_loras + 1, segments * max_rank, in] and
B [max_loras + 1, out, max_rank]. Slot 0 is "no adapter" and stays zero, so a base row
adds an exact zero whatever path computes it. The fused projections (qkv, gate_up) stack
their modules' A matrices (one shrink for all of them) and keep each module's B in its
own output rows (segment j of the output reads shrink columns [j*R, (j+1)*R)). The slabs
are allocated once, before the KV pool is sized; loading an adapter writes into them, so
CUDA graphs captured over them stay valid.

A plain (unquantized) projection's A slab is the tail rows of its own weight: the weight
is one [out + E, in] buffer whose first `out` rows are the base matrix, so a forward with
adapter rows makes one product of x with all of it, base output and every slot's shrink
at once (one GEMM a few % wider instead of a shrink launch; the H200 figures are in
docs/perf.md "Multi-LoRA"), and a forward without adapters multiplies by the first rows
alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..spec.hf_config import ModelConfig
from ..model.linear import Linear
from .adapter import LoraAdapter

# our projection -> its HF modules, in the order of its output segments
SEGMENTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
            "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}   # Phi-3 stores these fused
ALIGN = 64   # the A rows appended to a weight round up to this: a row length that was a multiple of 64 stays one


class LoraBatch:
    """The adapter slot of each token row of the forward being run (None: no row has one,
    the LoRA path is skipped). The runner sets it around a forward; every projection of
    that forward reads it. `groups`: the rows grouped by slot for the Triton kernels
    (engine/kernels/lora.py's group_rows: one launch per forward, no host sync).
    `shrink_alone`: the forward's rows are few enough that a projection shrinks through
    its own kernel, reading only their adapters' A (splitk-atomic), even where its weight
    carries every slot's. `side`: the stream such a delta runs on beside the base product,
    in forwards of up to OVERLAP_MAX_ROWS rows (None: after the product)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.idx: torch.Tensor | None = None       # int32 [T]
        self.groups = None                         # kernels.lora.Groups (grouped forwards)
        self.shrink_alone = False
        self.side: torch.cuda.Stream | None = None
        self._stream: torch.cuda.Stream | None = None

    def set(self, idx: torch.Tensor, grouped: bool) -> None:
        self.idx = idx
        if grouped:
            from ..kernels.lora import OVERLAP_MAX_ROWS, SPLITK_MAX_ROWS, group_rows

            self.groups = group_rows(idx, self.num_slots)
            self.shrink_alone = idx.shape[0] <= SPLITK_MAX_ROWS
            if idx.is_cuda and idx.shape[0] <= OVERLAP_MAX_ROWS:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(idx.device)
                self.side = self._stream

    def clear(self) -> None:
        self.idx = self.groups = self.side = None
        self.shrink_alone = False


class LoraProjection:
    """The LoRA slabs of one projection; `Linear` calls it in place of its base product.
    With `linear` a plain Linear, A lives in the tail rows of its weight (`weight`, `bias`:
    the whole buffers; linear.weight / .bias become views of their first rows)."""

    __slots__ = ("A", "B", "batch", "max_rank", "segments", "n", "rows", "weight", "bias")

    def __init__(self, segments: tuple[int, ...], n_in: int, max_rank: int, batch: LoraBatch,
                 dtype: torch.dtype, device: torch.device, linear: Linear | None = None):
        S = batch.num_slots
        self.segments = segments                  # output sizes of the fused modules
        self.max_rank = max_rank
        self.batch = batch
        self.n = n = sum(segments)
        self.rows = rows = S * len(segments) * max_rank   # A's rows: every slot's shrink columns
        self.weight = self.bias = None
        if type(linear) is Linear and linear.weight.dtype == dtype:
            extra = -(-rows // ALIGN) * ALIGN
            self.weight = torch.zeros(n + extra, n_in, dtype=dtype, device=device)
            self.weight[:n].copy_(linear.weight)
            linear.weight = nn.Parameter(self.weight[:n], requires_grad=False)
            if linear.bias is not None:
                self.bias = torch.zeros(n + extra, dtype=dtype, device=device)
                self.bias[:n].copy_(linear.bias)
                linear.bias = nn.Parameter(self.bias[:n], requires_grad=False)
            self.A = self.weight[n:n + rows].view(S, len(segments) * max_rank, n_in)
        else:
            self.A = torch.zeros(S, len(segments) * max_rank, n_in, dtype=dtype, device=device)
        self.B = torch.zeros(S, sum(segments), max_rank, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """base(x) plus each row's delta."""
        b = self.batch
        if b.idx is None:
            return base(x)
        from .delta import add_expand, add_lora, add_lora_beside

        if self.weight is None or b.shrink_alone:   # the delta with its own shrink
            if b.side is None:
                return add_lora(base(x), x, self.A, self.B, self.segments, b)
            return add_lora_beside(base, x, self.A, self.B, self.segments, b)
        n = self.n
        y = F.linear(x, self.weight, self.bias)          # [T, n + extra]: base | every slot's shrink
        return add_expand(y[:, :n], y[:, n:n + self.rows], self.B, self.segments, b)


def attach(model, mc: ModelConfig, max_loras: int, max_rank: int) -> LoraBatch:
    """Give every decoder projection of `model` its slabs; returns the shared LoraBatch."""
    batch = LoraBatch(max_loras + 1)
    h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    shapes = {"qkv": ((q, kv, kv), h), "o": ((h,), q), "gate_up": ((i, i), h), "down": ((h,), i)}
    for L in model.layers:
        for proj, (segments, n_in) in shapes.items():
            lin = getattr(L, proj)
            lin.lora = LoraProjection(segments, n_in, max_rank, batch, model.dtype,
                                      model.embed.device, lin)
    return batch


@torch.inference_mode()
def write_slot(model, slot: int, adapter: LoraAdapter) -> None:
    """Write `adapter` into device slot `slot` (> 0) of every projection's slabs, zeros
    where it has no matrix. In stream order: steps launched before still read the old
    contents, steps after read the new ones."""
    for L in model.layers:
        for proj in SEGMENTS:
            p = getattr(L, proj).lora
            p.A[slot].zero_()
            p.B[slot].zero_()
    for (layer, module), (a, b) in adapter.weights.items():
        proj = FUSED.get(module) or next(k for k, mods in SEGMENTS.items() if module in mods)
        p = getattr(model.layers[layer], proj).lora
        R, r = p.max_rank, a.shape[0]
        parts = (range(len(p.segments)) if module in FUSED
                 else [SEGMENTS[proj].index(module)])
        for j in parts:
            n0 = sum(p.segments[:j])
            n = p.segments[j]
            p.A[slot, j * R:j * R + r].copy_(a)
            rows = b[n0:n0 + n] if module in FUSED else b
            p.B[slot, n0:n0 + n, :r].copy_(rows)
