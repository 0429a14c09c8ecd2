"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, Gemma 2/3, and the
mixtures of experts Mixtral and Qwen3-MoE) over flat token batches.

Weights are fused at load time: q/k/v into one `qkv` projection, gate/up into `gate_up`;
every projection is a `Linear` (linear.py), where quantization, shards and LoRA plug in.
Gemma's differences are per-config switches: norm weights stored as 1 + w by the loader,
extra norms after attention and after the MLP, GeGLU, scaled embeddings, soft-capping, and
per-layer sliding windows (with their own RoPE base in Gemma 3). A mixture-of-experts
layer's MLP is moe.SparseMoE (the layers mc.moe_layers names).
The forward takes a flat batch of tokens ([T]) with their positions and the attention
metadata of the step (prefill chunks or one decode token per sequence).
Split over tensor-parallel ranks (`tp`, parallel.py), each rank builds the model with its
heads and MLP slice (`rank_config`), row-parallel o / down, and its rows of the vocabulary.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import ops
from .linear import VocabParallelHead, param as _p, row_linear
from ..spec.hf_config import ModelConfig
from .moe import SparseMoE
from ..spec.sizing import rank_config, vocab_rows
from ..spec.quant import QuantConfig
from ..quant.fp8 import Fp8Acts
from ..quant.linear import Fp8Linear, build_linear
from .rope import cos_sin_cache
from ..tuning import Tuning


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor            # int64 [T]
    block_tables: torch.Tensor            # int32 [B, W]
    context_lens: torch.Tensor            # int32 [B]
    cu_seqlens_q: torch.Tensor | None     # int32 [B+1]; None = decode (one token per row)
    no_prefix: bool = False               # prefill: every chunk starts at position 0
    seqlens_q: list[int] | None = None    # prefill: host copy of the chunk lengths
    # One forward a step: the last decode_tail rows of a prefill forward hold the step's
    # decodes, one query each, outside every prefill sequence; their attention is the
    # decode kernel's (a row with context length 0 is a chunk's or padding: left as is).
    decode_tail: int = 0
    decode_block_tables: torch.Tensor | None = None   # int32 [decode_tail, W]
    decode_context_lens: torch.Tensor | None = None   # int32 [decode_tail]


class Layer(nn.Module):
    def __init__(self, mc: ModelConfig, dtype, device, window: int = 0, index: int = 0,
                 quant: QuantConfig | None = None, tp=None):
        super().__init__()
        self.window = window   # sliding window of this layer's attention; 0 = global
        self.k_scale = self.v_scale = 1.0   # FP8 KV cache: the checkpoint's scales, else 1
        h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
        hf = f"model.layers.{index}."      # the checkpoint's module names (quantization's ignore list)

        def linear(parts, inp, bias):
            return build_linear(quant, [(hf + n, r) for n, r in parts], inp, bias=bias, dtype=dtype, device=device)

        fused = mc.spec.fused_checkpoint
        self.input_norm = _p(h, dtype=dtype, device=device)
        self.post_norm = _p(h, dtype=dtype, device=device)      # the norm before the MLP
        # Gemma: norms on the attention output and on the MLP output
        self.post_attn_norm = _p(h, dtype=dtype, device=device) if mc.gemma_norms else None
        self.post_mlp_norm = _p(h, dtype=dtype, device=device) if mc.gemma_norms else None
        self.qkv = linear([("self_attn.qkv_proj", q + 2 * kv)] if fused else
                          [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
                          h, mc.qkv_bias)
        # split over ranks (parallel.check_tp refuses FP8 there): o and down sum the ranks' parts
        self.o = (row_linear(h, q, bias=mc.o_bias, dtype=dtype, device=device, tp=tp) if tp is not None
                  else linear([("self_attn.o_proj", h)], q, mc.o_bias))
        self.q_norm = _p(mc.head_dim, dtype=dtype, device=device) if mc.qk_norm else None
        self.k_norm = _p(mc.head_dim, dtype=dtype, device=device) if mc.qk_norm else None
        if mc.moe_layers and mc.moe_layers[index]:
            self.moe = SparseMoE(mc, dtype, device)
        else:
            self.moe = None
            self.gate_up = linear([("mlp.gate_up_proj", 2 * i)] if fused else
                                  [("mlp.gate_proj", i), ("mlp.up_proj", i)], h, mc.mlp_bias)
            self.down = (row_linear(h, i, bias=mc.mlp_bias, dtype=dtype, device=device, tp=tp)
                         if tp is not None else linear([("mlp.down_proj", h)], i, mc.mlp_bias))


class LlamaModel(nn.Module):
    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quant: QuantConfig | None = None, tp=None, tuning: Tuning | None = None):
        super().__init__()
        self.tp = tp
        self._tuning = tuning or Tuning()
        world = tp.world if tp is not None else 1
        self.mc = mc = rank_config(mc, world)
        self.dtype = dtype
        rows = vocab_rows(mc.vocab_size, world)
        self.vocab_start = tp.rank * rows if tp is not None else 0
        self.embed = _p(rows, mc.hidden_size, dtype=dtype, device=device)
        windows = mc.layer_windows or [0] * mc.num_layers
        self.layers = nn.ModuleList(Layer(mc, dtype, device, w, i, quant, tp) for i, w in enumerate(windows))
        self.norm = _p(mc.hidden_size, dtype=dtype, device=device)
        if tp is None:
            # a tied head shares the embedding, which stays in the model dtype
            self.lm_head = build_linear(None if mc.tie_word_embeddings else quant, [("lm_head", mc.vocab_size)],
                                        mc.hidden_size, bias=False, dtype=dtype, device=device)
        else:
            self.lm_head = VocabParallelHead(mc.vocab_size, rows, mc.hidden_size, dtype=dtype,
                                             device=device, tp=tp)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.embed
        self.scale = mc.attn_scale or mc.head_dim ** -0.5
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as transformers does
        self.embed_scale = (float(torch.tensor(mc.hidden_size ** 0.5, dtype=dtype))
                            if mc.gemma_norms else None)
        self.act = ops.gelu_tanh_and_mul if mc.hidden_act == "gelu_tanh" else ops.silu_and_mul
        self.ops = ops.model_ops(mc.head_dim)     # kernels, or references where head_dim does not fit them
        self._cos_sin: torch.Tensor | None = None
        self.local_cos_sin: torch.Tensor | None = None  # Gemma 3's sliding layers

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        """The engine's tuning, for the model and each FP8 projection in it."""
        self._tuning = tuning
        for m in self.modules():
            if isinstance(m, Fp8Linear):
                m.tuning = tuning

    @property
    def cos_sin(self) -> torch.Tensor | None:
        """The RoPE cache (ops.apply_rope layout); the runner sets it for max_model_len."""
        return self._cos_sin

    @cos_sin.setter
    def cos_sin(self, cache: torch.Tensor) -> None:
        self._cos_sin = cache
        if self.mc.local_rope_theta is not None:
            local = replace(self.mc, rope_theta=self.mc.local_rope_theta, rope_scaling=None)
            self.local_cos_sin = cos_sin_cache(local, cache.shape[0], cache.dtype, cache.device)

    # ------------------------------------------------------------------ attention
    def _attention(self, L: Layer, x: torch.Tensor | Fp8Acts, positions: torch.Tensor,
                   kv: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        mc = self.mc
        t = positions.shape[0]
        qkv = L.qkv(x)
        q, k, v = qkv.split([mc.q_size, mc.kv_size, mc.kv_size], dim=-1)
        q = q.reshape(t, mc.num_heads, mc.head_dim)
        k = k.reshape(t, mc.num_kv_heads, mc.head_dim)
        v = v.reshape(t, mc.num_kv_heads, mc.head_dim)
        if L.q_norm is not None:
            q = ops.rms_norm(q, L.q_norm, mc.rms_norm_eps)
            k = ops.rms_norm(k, L.k_norm, mc.rms_norm_eps)
        mops = self.ops
        cos_sin = self.local_cos_sin if L.window and self.local_cos_sin is not None else self._cos_sin
        k_cache, v_cache = kv[0], kv[1]
        # FP8 KV pages: the ops quantize on write and dequantize on read with these
        kv_scales = dict(k_scale=L.k_scale, v_scale=L.v_scale) if kv.dtype == ops.FP8 else {}
        q, k = mops.rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, **kv_scales)
        extra = {}
        if L.window or mc.attn_softcap:   # only the models that use them pass them
            extra = dict(window=L.window, softcap=mc.attn_softcap)
        if meta.cu_seqlens_q is None:
            o = mops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      self.scale, **extra, **kv_scales)
        elif (meta.no_prefix and q.is_cuda and meta.seqlens_q is not None and not extra
              and (len(meta.seqlens_q) <= 8 or not mops.has_kernel("prefill_attention"))):
            o = _sdpa_varlen(q, k, v, meta.seqlens_q, self.scale, self.tuning)
        else:
            o = mops.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                      meta.context_lens, self.scale, **extra, **kv_scales)
            if meta.decode_tail:
                # the decodes' one-query rows through the decode kernel, which splits each
                # context over the GPU (the prefill kernel's 64-row query tiles would hold
                # one row and walk the whole context in one program)
                n = meta.decode_tail
                od = mops.decode_attention(q[t - n:], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_context_lens, self.scale, **extra, **kv_scales)
                live = (meta.decode_context_lens > 0).view(n, 1, 1)
                o[t - n:] = torch.where(live, od, o[t - n:])
        return L.o(o.reshape(t, mc.q_size))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttnMeta, layers: list[int] | None = None) -> torch.Tensor:
        """hidden states after the final norm, [T, hidden]. kv: [layers, 2, pages, page, Hk, D].
        layers: only these (the warm-up's `layer_kinds`; their output is not the model's)."""
        eps = self.mc.rms_norm_eps
        h = self._embed(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual = None
        for i in range(len(self.layers)) if layers is None else layers:
            L = self.layers[i]
            # FP8 projections may take their input quantized by the kernel before them
            fp8_qkv = L.qkv.takes_fp8(h)
            if residual is None:
                residual = h
                x = ops.rms_norm(h, L.input_norm, eps, quantize=fp8_qkv)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, L.input_norm, eps, quantize=fp8_qkv)
            h = self._attention(L, x, positions, kv[i], meta)
            if L.post_attn_norm is not None:
                h = ops.rms_norm(h, L.post_attn_norm, eps)
            if L.moe is not None:
                x, residual = ops.fused_add_rms_norm(h, residual, L.post_norm, eps)
                h = L.moe(x, self.act)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, L.post_norm, eps,
                                                     quantize=L.gate_up.takes_fp8(h))
                h = L.down(self.act(L.gate_up(x), quantize=L.down.takes_fp8(h)))
            if L.post_mlp_norm is not None:
                h = ops.rms_norm(h, L.post_mlp_norm, eps)
        x, _ = ops.fused_add_rms_norm(h, residual, self.norm, eps)
        return x

    def layer_kinds(self) -> list[int]:
        """One layer of each kind the forward runs: the first (its norm takes no residual),
        the second (the first whose input norm adds one), then the first of every other
        kind (sliding window, mixture of experts, the norms, each projection's class: a
        quantization ignore list can leave some plain, LoRA on some). Every kernel variant
        a forward launches, these launch too (same shapes, strides and arguments): the
        warm-up runs them alone. All layers when Tuning.warmup_layer_kinds is off."""
        if not self.tuning.warmup_layer_kinds:
            return list(range(len(self.layers)))
        def kind(L: Layer) -> tuple:
            projections = (L.qkv, L.o) + ((L.gate_up, L.down) if L.moe is None else ())
            return (L.window, L.moe is not None, L.q_norm is not None, L.post_attn_norm is not None,
                    tuple((type(m).__name__, m.lora is not None) for m in projections))
        out, seen = [0] if len(self.layers) else [], set()
        for i, L in enumerate(self.layers):
            if i and kind(L) not in seen:
                seen.add(kind(L))
                out.append(i)
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.embed)
        # vocabulary-parallel: each rank looks up the ids in its rows, zeros the others; the sum
        # over the ranks is the embedding
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.mc.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


# Fresh prompts' attention, one SDPA call per sequence. On the H200 the default backend is
# cuDNN's, which builds a plan for every new sequence length (~42 ms of the step thread,
# stalling every stream) and then runs up to 2x faster than flash at 16K (1.7x at 2K); flash
# builds nothing and is as fast up to ~512 tokens (docs/perf.md, "Step stalls"). So: the
# backends without plans up to Tuning.sdpa_flash_max_len, the default above it with lengths
# padded to ~8 per power of two (a plan per bucket, built by the warm-up before READY).
# Trailing padding is exact under the causal mask (no real query sees a later key), at most
# 1/8 more attention work.
_PLANLESS_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_length(n: int) -> int:
    """n rounded up to a multiple of an eighth of its power of two (of 16 at least)."""
    step = max(16, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int],
                 scale: float, tuning: Tuning) -> torch.Tensor:
    """Causal attention over the step's own contiguous q/k/v (no cached prefix), CUDA:
    SDPA per sequence (4-D, GQA through enable_gqa), the backend by its length (above)."""
    hq, hk = q.shape[1], k.shape[1]
    gqa = hq != hk
    out = []
    s0 = 0
    for n in seqlens:
        qb = q[s0:s0 + n].transpose(0, 1).unsqueeze(0)
        kb = k[s0:s0 + n].transpose(0, 1).unsqueeze(0)
        vb = v[s0:s0 + n].transpose(0, 1).unsqueeze(0)
        short = n <= tuning.sdpa_flash_max_len
        if not short and tuning.sdpa_pad_lengths:
            # zeros after the last token; a length already on a bucket is copied the same way,
            # so both reach cuDNN with one layout and share one plan per bucket
            m = sdpa_length(n)
            qb, kb, vb = (F.pad(t, (0, 0, 0, m - n)) if m > n else t.contiguous() for t in (qb, kb, vb))
        with sdpa_kernel(_PLANLESS_SDPA) if short else nullcontext():
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        out.append(o[0, :, :n].transpose(0, 1))
        s0 += n
    return torch.cat(out, 0) if len(out) > 1 else out[0]
