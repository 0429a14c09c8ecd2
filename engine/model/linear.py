"""A projection, y = x Wᵀ (+ b): the one seam every matrix of the model goes through.

The model calls each projection (q/k/v, o, gate/up, down, the LM head) through `Linear`,
so what varies per deployment plugs in here and nowhere else: quantized weights replace
`weight` with their own forward, tensor-parallel shards hold a slice of the rows or
columns, LoRA adds its delta to the base product (for a plain projection, through a wider
product whose extra rows are the adapters' A: engine/lora/slabs.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import gemm_table


def param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    lora = None   # engine/lora's LoraProjection of this projection, with --enable-lora

    def __init__(self, out_features: int, in_features: int, *, bias: bool, dtype, device):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = param(out_features, in_features, dtype=dtype, device=device)
        self.bias = param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base product (subclasses: quantized, split over ranks): cuBLAS, or a skinny
        Triton GEMM where the device's table measured one faster for this shape and M."""
        w = self.weight
        if gemm_table.cells and self.bias is None and x.dim() == 2:
            cfg = gemm_table.choice(x.dtype, w.shape[0], w.shape[1], x.shape[0])
            if cfg is not None:
                return gemm_table.kernels().skinny_matmul(x, w, cfg=cfg)
        return F.linear(x, w, self.bias)

    def takes_fp8(self, x: torch.Tensor) -> bool:
        """Whether this step's input may come quantized per token (quant.fp8.Fp8Acts) from
        the kernel before the projection; x: any activation of the step (its rows, dtype
        and device decide). A plain projection takes its input as it is."""
        return False

    # nn.Module.__call__'s hook machinery costs microseconds per call, and an eager
    # forward makes seven calls per layer: call forward directly. With LoRA rows in the
    # forward, the LoraProjection makes the product and adds the delta.
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) if self.lora is None else self.lora(x, self.forward)


# ---------------------------------------------------------------------- tensor-parallel shards
# A column-parallel projection (qkv, gate_up) is a plain `Linear` over the rank's rows: its
# output is the rank's heads / MLP slice and needs no communication. The two below end in a
# collective; `tp` is the rank's parallel.TPGroup.

class RowParallelLinear(Linear):
    """o and down: the rank's columns of W times its slice of x, summed over the ranks
    (all-reduce); the bias is added once, after the sum."""

    def __init__(self, out_features: int, in_features: int, *, bias: bool, dtype, device, tp):
        super().__init__(out_features, in_features, bias=bias, dtype=dtype, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelHead(Linear):
    """The LM head over the rank's rows of the vocabulary (vocab_rows each, the last rank's
    tail zero padding); the logits are all-gathered, so every rank returns [T, vocab]."""

    def __init__(self, vocab: int, rows: int, in_features: int, *, dtype, device, tp):
        super().__init__(rows, in_features, bias=False, dtype=dtype, device=device)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_cols(F.linear(x, self.weight))[:, :self.vocab]


def row_linear(out_features: int, in_features: int, *, bias: bool, dtype, device, tp) -> Linear:
    """A row-parallel projection: the plain Linear when the model is not split."""
    if tp is None:
        return Linear(out_features, in_features, bias=bias, dtype=dtype, device=device)
    return RowParallelLinear(out_features, in_features, bias=bias, dtype=dtype, device=device, tp=tp)
