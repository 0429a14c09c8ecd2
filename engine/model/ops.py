"""The hot ops: torch references (run everywhere) and dispatch to Triton on CUDA.

Exact names and signatures are a contract with `kernels/` (docs/engine-interface.md).
When a tensor is on CUDA and `zerod.engine.kernels.CUDA_KERNELS` holds the op's name,
that function is called with the same arguments instead of the reference.

The attention-side kernels are specialised on the head dimension; a model whose head_dim
they cannot take gets the torch references through its own `ModelOps` (`model_ops`), so
one engine's model never changes what another one runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

try:  # the kernels helper's table; may be missing or empty
    from ..kernels import CUDA_KERNELS as _K  # type: ignore[attr-defined]
    if not isinstance(_K, dict):
        _K = {}
except Exception:  # noqa: BLE001 - a broken kernels package must not break the engine
    _K = {}

# Ops that callers may turn off (tests compare kernel against reference this way).
DISABLED: set[str] = set()


@contextmanager
def kernels_disabled(names):
    """Within the block the named ops run their torch reference, even on CUDA."""
    saved = set(DISABLED)
    DISABLED.update(names)
    try:
        yield
    finally:
        DISABLED.clear()
        DISABLED.update(saved)


def _kernel(name: str, t: torch.Tensor):
    if t.is_cuda and name not in DISABLED:
        return _K.get(name)
    return None


def has_kernel(name: str) -> bool:
    return name in _K and name not in DISABLED


# ---------------------------------------------------------------- norms / activations

# quantize=True: the output as FP8 per token (quant.fp8.Fp8Acts), for an FP8 projection
# next that asked for it (Linear.takes_fp8); the kernels quantize in their own launch, the
# references after, with the quantization kernel (a CUDA-only request).

def _quantized(x: torch.Tensor, quantize: bool):
    if not quantize:
        return x
    from ..quant.fp8 import Fp8Acts
    from ..quant.triton_fp8 import quantize_tokens
    return Fp8Acts(*quantize_tokens(x.reshape(-1, x.shape[-1])))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False):
    k = _kernel("rms_norm", x)
    if k is not None:
        return k(x, weight, eps, quantize)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _quantized(weight * xf.to(x.dtype), quantize)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quantize: bool = False):
    k = _kernel("fused_add_rms_norm", x)
    if k is not None:
        return k(x, residual, weight, eps, quantize)
    new_residual = x + residual
    xf = new_residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _quantized(weight * xf.to(x.dtype), quantize), new_residual


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    k = _kernel("silu_and_mul", x)
    if k is not None:
        return k(x, quantize)
    i = x.shape[-1] // 2
    return _quantized(F.silu(x[..., :i]) * x[..., i:], quantize)


def gelu_tanh_and_mul(x: torch.Tensor, quantize: bool = False):
    """GeGLU (Gemma): gelu_tanh(gate) * up over [..., 2*I]; torch on every device."""
    i = x.shape[-1] // 2
    return _quantized(F.gelu(x[..., :i], approximate="tanh") * x[..., i:], quantize)


# ---------------------------------------------------------------- rope

def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernel("apply_rope", q)
    if kern is not None:
        return kern(q, k, positions, cos_sin_cache)
    return apply_rope_reference(q, k, positions, cos_sin_cache)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin_cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        # HF: x * cat(cos,cos) + rotate_half(x) * cat(sin,sin), in x.dtype
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rot(q), rot(k)


# ---------------------------------------------------------------- KV cache + attention
# FP8 caches (float8_e4m3fn, `--kv-cache-dtype fp8`): the ops take the layer's per-tensor
# k_scale / v_scale (value = fp8 * scale); write_kv quantizes, attention dequantizes.

FP8 = torch.float8_e4m3fn


def _kv_in(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the cache stores it (FP8: divided by the scale, saturated)."""
    if cache.dtype != FP8:
        return x.to(cache.dtype)
    return (x.float() / scale).clamp_(-448.0, 448.0).to(FP8)


def _kv_out(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached K or V in float32 (FP8: times its scale)."""
    return x.float() * scale if x.dtype == FP8 else x.float()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, **kv_scales) -> None:
    kern = _kernel("write_kv", k)
    if kern is not None:
        kern(k, v, k_cache, v_cache, slot_mapping, **kv_scales)
        return
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, **kv_scales)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    hk, d = k.shape[-2], k.shape[-1]
    if k_cache.dtype == FP8:   # index_copy_ has no float8 kernel on the CPU: copy the bytes
        k_cache.view(torch.uint8).view(-1, hk, d).index_copy_(0, slot_mapping, _kv_in(k, k_cache, k_scale).view(torch.uint8))
        v_cache.view(torch.uint8).view(-1, hk, d).index_copy_(0, slot_mapping, _kv_in(v, v_cache, v_scale).view(torch.uint8))
        return
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, **kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope, then write_kv of the rotated k and v: (q, k) rotated. One launch on CUDA."""
    kern = _kernel("rope_write_kv", q)
    if kern is not None:
        return kern(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, **kv_scales)
    return rope_write_kv_reference(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                   **kv_scales)


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, **kv_scales) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = apply_rope_reference(q, k, positions, cos_sin_cache)
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, **kv_scales)
    return q, k


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, W*page, Hk, D] of the pages named by block_tables."""
    b, w = block_tables.shape
    g = cache.index_select(0, block_tables.reshape(-1).long())  # [B*W, page, Hk, D]
    return g.view(b, w * cache.shape[1], cache.shape[2], cache.shape[3])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, *, window: int = 0, softcap: float = 0.0, **kv_scales) -> torch.Tensor:
    """window > 0: each query sees its last `window` keys (itself included);
    softcap > 0: scores become softcap * tanh(score / softcap) before the softmax."""
    kern = _kernel("decode_attention", q)
    if kern is not None:
        return kern(q, k_cache, v_cache, block_tables, context_lens, scale, window=window, softcap=softcap,
                    **kv_scales)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      window=window, softcap=softcap, **kv_scales)


def _softcap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(s / softcap) * softcap if softcap else s


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, *, window: int = 0, softcap: float = 0.0,
                               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    k = _gather(k_cache, block_tables)  # [B, L, Hk, D]
    v = _gather(v_cache, block_tables)
    L = k.shape[1]
    pos = torch.arange(L, device=q.device).unsqueeze(0)
    ctx = context_lens.unsqueeze(1).long()
    valid = pos < ctx  # [B, L]
    if window:
        valid &= pos >= ctx - window
    qg = q.view(b, hk, hq // hk, d).float()
    s = _softcap(torch.einsum("bhgd,blhd->bhgl", qg, _kv_out(k, k_scale)) * scale, softcap)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgl,blhd->bhgd", p, _kv_out(v, v_scale))
    return o.reshape(b, hq, d).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, *, window: int = 0,
                      softcap: float = 0.0, **kv_scales) -> torch.Tensor:
    """window and softcap as in decode_attention."""
    kern = _kernel("prefill_attention", q)
    if kern is not None:
        return kern(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                    window=window, softcap=softcap, **kv_scales)
    return prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                       window=window, softcap=softcap, **kv_scales)


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, *, window: int = 0,
                                softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    t, hq, d = q.shape
    hk = k_cache.shape[2]
    g = hq // hk
    page = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    out = torch.empty_like(q)
    for b in range(len(ctx)):
        s0, s1 = cu[b], cu[b + 1]
        n, c = s1 - s0, ctx[b]
        if n == 0:
            continue
        npages = (c + page - 1) // page
        bt = block_tables[b, :npages].long()
        k = k_cache.index_select(0, bt).reshape(-1, hk, d)[:c]  # [C, Hk, D]
        v = v_cache.index_select(0, bt).reshape(-1, hk, d)[:c]
        if k_cache.dtype == FP8:
            k, v = _kv_out(k, k_scale).to(q.dtype), _kv_out(v, v_scale).to(q.dtype)
        qb = q[s0:s1].view(n, hk, g, d).permute(1, 2, 0, 3)  # [Hk, G, N, D]
        kb = k.permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, C, D]
        vb = v.permute(1, 0, 2).unsqueeze(1)
        # query i (absolute position c-n+i) sees keys 0..c-n+i
        qpos = torch.arange(c - n, c, device=q.device).unsqueeze(1)
        kpos = torch.arange(c, device=q.device).unsqueeze(0)
        mask = kpos <= qpos  # [N, C]
        if window:
            mask &= kpos > qpos - window
        kb, vb = kb.expand(hk, g, c, d), vb.expand(hk, g, c, d)
        if softcap:  # SDPA has no soft-cap: the scores by hand, in float32
            s = _softcap(torch.einsum("hgnd,hgcd->hgnc", qb.float(), kb.float()) * scale, softcap)
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            o = torch.einsum("hgnc,hgcd->hgnd", p, vb.float()).to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
        out[s0:s1] = o.permute(2, 0, 1, 3).reshape(n, hq, d)
    return out


# ---------------------------------------------------------------- per model

# Ops whose kernels are specialised on head_dim (a power of two >= 16).
HEAD_DIM_OPS = ("apply_rope", "write_kv", "rope_write_kv", "decode_attention", "prefill_attention")


def kernels_take_head_dim(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@dataclass(frozen=True)
class ModelOps:
    """The head-dim specialised ops as one model calls them."""
    rope_write_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    head_dim_kernels: bool      # False: the three ops above run their torch references

    def has_kernel(self, name: str) -> bool:
        return (self.head_dim_kernels or name not in HEAD_DIM_OPS) and has_kernel(name)


def model_ops(head_dim: int) -> ModelOps:
    if kernels_take_head_dim(head_dim):
        return ModelOps(rope_write_kv, decode_attention, prefill_attention, True)
    return ModelOps(rope_write_kv_reference, decode_attention_reference, prefill_attention_reference, False)
