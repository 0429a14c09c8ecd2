"""Plain-torch references for the kernels of this package.

The engine's own references live in `zerod.engine.model.ops` (they are what the model
runs on the CPU, and they dispatch to `CUDA_KERNELS` on CUDA). This module keeps
an independent copy of the same semantics so that the kernel tests and the
device benchmark can (a) run before or without `ops.py` and (b) time a torch
version *on the GPU*, which `ops.py` cannot give once it dispatches to the
kernels. Semantics follow docs/engine-interface.md; rounding follows Hugging
Face's Llama code (normalise in float32, cast, then scale by the weight).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def apply_rope(q, k, positions, cos_sin_cache):
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    cos = cs[:, :half].float().unsqueeze(1)
    sin = cs[:, half:].float().unsqueeze(1)

    def rot(x):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kc[slots] = k[keep]
    vc[slots] = v[keep]


def rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    q, k = apply_rope(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _gather(cache, block_table, n):
    """The first n tokens of one sequence from a paged cache -> [n, Hk, D]."""
    page_size = cache.shape[1]
    pages = block_table[: (n + page_size - 1) // page_size].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def _softcap(s, softcap):
    return torch.tanh(s / softcap) * softcap if softcap else s


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, window=0, softcap=0.0):
    """One query token per sequence; loops over sequences (clear, not fast). window > 0:
    the last `window` keys only; softcap > 0: scores become softcap * tanh(s / softcap)."""
    B, Hq, D = q.shape
    Hk = k_cache.shape[2]
    g = Hq // Hk
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        k = _gather(k_cache, block_tables[b], n).float().repeat_interleave(g, dim=1)
        v = _gather(v_cache, block_tables[b], n).float().repeat_interleave(g, dim=1)
        s = _softcap(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, softcap)
        if window:
            s[:, : max(n - window, 0)] = float("-inf")
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


def decode_attention_batched(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Vectorised torch version (gather every page of the table, mask, softmax).

    What a plain-torch engine would run on the GPU; the benchmark times it.
    """
    B, Hq, D = q.shape
    Hk = k_cache.shape[2]
    g = Hq // Hk
    page_size = k_cache.shape[1]
    L = block_tables.shape[1] * page_size
    k = k_cache[block_tables.long()].reshape(B, L, Hk, D)
    v = v_cache[block_tables.long()].reshape(B, L, Hk, D)
    qg = q.view(B, Hk, g, D)
    s = torch.einsum("bkgd,blkd->bkgl", qg, k).float() * scale
    mask = torch.arange(L, device=q.device)[None, :] >= context_lens[:, None]
    s.masked_fill_(mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    o = torch.einsum("bkgl,blkd->bkgd", p, v)
    return o.reshape(B, Hq, D)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *,
                      window=0, softcap=0.0):
    """Causal; the chunk of sequence b is its last q_len tokens (a cached prefix may precede).
    window and softcap as in decode_attention."""
    T, Hq, D = q.shape
    Hk = k_cache.shape[2]
    g = Hq // Hk
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        ql = s1 - s0
        if ql == 0:
            continue
        n = int(context_lens[b])
        k = _gather(k_cache, block_tables[b], n).float().repeat_interleave(g, dim=1)
        v = _gather(v_cache, block_tables[b], n).float().repeat_interleave(g, dim=1)
        s = _softcap(torch.einsum("qhd,nhd->hqn", q[s0:s1].float(), k) * scale, softcap)
        qpos = torch.arange(n - ql, n, device=q.device)
        kpos = torch.arange(n, device=q.device)
        hide = kpos[None, :] > qpos[:, None]
        if window:
            hide |= kpos[None, :] <= qpos[:, None] - window
        s.masked_fill_(hide[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[s0:s1] = torch.einsum("hqn,nhd->qhd", p, v).to(q.dtype)
    return out


REFERENCES = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "apply_rope": apply_rope,
    "silu_and_mul": silu_and_mul,
    "write_kv": write_kv,
    "rope_write_kv": rope_write_kv,
    "decode_attention": decode_attention,
    "prefill_attention": prefill_attention,
}
