"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): the router and the experts.

The router is a projection to one logit per expert; softmax in float32, the top k, and
(Mixtral, Qwen3-MoE with norm_topk_prob) the k probabilities renormalised to sum to 1, as
transformers does. Expert weights are stacked at load: w13 [E, 2I, H] (gate rows, then
up rows) and w2 [E, H, I]. On CUDA the router's top k is one Triton launch
(kernels/router.py) and the experts run as the fused Triton kernel (kernels/moe.py: no
per-expert loop, no host sync); elsewhere, or with "fused_moe" in ops.DISABLED, the torch
references below, the experts looped over like transformers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from ..spec.hf_config import ModelConfig
from .linear import Linear, param

KERNEL = "fused_moe"     # the name ops.kernels_disabled takes to run the reference on CUDA


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids [T, k]) from the router's logits [T, E]: one
    launch on CUDA (kernels/router.py, int32 ids), the torch reference elsewhere."""
    if _kernel(logits) is not None:
        from ..kernels.router import MAX_EXPERTS, route as route_kernel
        if logits.shape[-1] <= MAX_EXPERTS:
            return route_kernel(logits, top_k, renormalise)
    return route_reference(logits, top_k, renormalise)


def route_reference(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing: softmax in float32, the top k, renormalised on request."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """transformers' expert loop: each expert's tokens through it, weighted, added up."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        h = F.linear(act(F.linear(x[tok], w13[e])), w2[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def _kernel(x: torch.Tensor):
    """The Triton path where the engine's kernels are on (CUDA, Triton, not disabled)."""
    if not x.is_cuda or KERNEL in ops.DISABLED:
        return None
    from ..kernels import CUDA_KERNELS
    if not CUDA_KERNELS:     # no Triton, or ZEROD_DISABLE_TRITON: the same policy as every kernel
        return None
    from ..kernels.moe import fused_experts
    return fused_experts


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    kern = _kernel(x)
    if kern is not None:
        return kern(x, w13, w2, topk_weights, topk_ids, act)
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, act)


class SparseMoE(nn.Module):
    def __init__(self, mc: ModelConfig, dtype, device):
        super().__init__()
        e, h, i = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
        self.top_k = mc.experts_per_token
        self.renormalise = mc.norm_topk_prob
        self.gate = Linear(e, h, bias=False, dtype=dtype, device=device)
        self.w13 = param(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = param(e, h, i, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        return fused_experts(x, self.w13, self.w2, weights, ids, act)

    def __call__(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return self.forward(x, act)    # skip nn.Module's hook machinery, as Linear does
