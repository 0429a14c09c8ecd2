"""A mixture-of-experts router's top k on CUDA, in one launch: the softmax over the
experts in float32, the k largest (ties to the lower expert id), and the k probabilities
renormalised to sum to 1 where the model asks for it.

torch runs this as a launch each for the float cast, softmax, topk, the sum and the
division, and the experts then want the ids cast to int32 (what that costs a Mixtral
step: docs/perf.md "Kernels"). One program holds BLOCK_T tokens' logits in registers
(E <= 256 experts). The router's projection stays cuBLAS's, as transformers runs it, so
the logits (and so the experts chosen) are the ones the reference sees.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 256


# T is only compared against: not specialised, so the token count never selects a variant
@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t,
                  TOP_K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, EP: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, EP)
    live = rows < T
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + e[None, :],
                mask=live[:, None] & (e[None, :] < E), other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    k = tl.arange(0, KP)      # TOP_K slots padded to a power of two
    picked_w = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    rest = tl.where(e[None, :] < E, p, -1.0)     # padding experts never win
    for j in tl.static_range(TOP_K):
        best = tl.max(rest, axis=1)
        # a NaN logit matches nothing: clamped, the id still names an expert
        idx = tl.minimum(tl.min(tl.where(rest == best[:, None], e[None, :], EP), axis=1), E - 1)
        picked_w = tl.where(k[None, :] == j, best[:, None], picked_w)
        picked_i = tl.where(k[None, :] == j, idx[:, None], picked_i)
        rest = tl.where(e[None, :] == idx[:, None], -1.0, rest)
    if RENORM:
        picked_w = picked_w / tl.sum(picked_w, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + k[None, :]
    keep = live[:, None] & (k[None, :] < TOP_K)
    tl.store(w_ptr + out, picked_w, mask=keep)
    tl.store(ids_ptr + out, picked_i, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int32 [T, k]) from the router's logits [T, E]."""
    t, e = logits.shape
    if not 1 <= top_k <= e <= MAX_EXPERTS:
        raise ValueError(f"router kernel: top {top_k} of {e} experts (at most {MAX_EXPERTS})")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    ep = max(16, triton.next_power_of_2(e))
    block_t = max(1, min(16, 2048 // ep))      # a tile of <= 2K logits a program
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0),
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), RENORM=bool(renormalise),
        EP=ep, BLOCK_T=block_t, num_warps=4)
    return weights, ids
