"""A projection, y = x Wᵀ (+ b): the one seam every matrix of the model goes through.

The model calls each projection (q/k/v, o, gate/up, down, the LM head) through `Linear`,
so what varies per deployment plugs in here and nowhere else: quantized weights replace
`weight` with their own forward, tensor-parallel shards hold a slice of the rows or
columns, LoRA adds its delta after the base product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            y = self.lora(x, y)
        return y

    # nn.Module.__call__'s hook machinery costs microseconds per call, and an eager
    # forward makes seven calls per layer: call forward directly.
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)
