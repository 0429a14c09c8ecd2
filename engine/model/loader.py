"""Safetensors (single or sharded with model.safetensors.index.json) into LlamaModel (experts
stacked per layer into w13 / w2, see moe.py); `load_format="dummy"` fills random weights
directly on the device. A tensor-parallel rank reads only its slice of each tensor; FP8
projections load through quant/loading.py's entries (weights, scales, KV scales).

A broken checkpoint (unreadable file, missing or misshapen tensor, unknown tensor name,
index naming a missing shard) raises EngineError naming the file and the tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineError
from ..spec.checkpoint import checkpoint_files
from ..spec.hf_config import ModelConfig
from .decoder import LlamaModel
from .moe import SparseMoE
from ..tp.parallel import kv_head_start
from ..spec.quant import QuantConfig
from ..quant.loading import fp8_loaders, init_dummy_fp8

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NORM = re.compile(r"(norm|layernorm)\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: `param` rows from `off`, filled with the slice
    [start, start + size) of the tensor along `dim` (size None: all of it). A rank of a
    tensor-parallel group reads only its slice (safetensors' get_slice), so no process
    ever holds a whole checkpoint tensor it does not serve."""
    param: torch.Tensor
    off: int
    shape: tuple[int, ...]       # the tensor's shape in the checkpoint, as config.json implies
    dim: int = 0
    start: int = 0
    size: int | None = None


def _targets(model: LlamaModel, mc: ModelConfig, rank: int = 0, n: int = 1) -> dict[str, _Target]:
    """HF tensor name -> its target in the fused layout; mc is the whole model's config,
    model holds rank `rank`'s shard of n."""
    T = _Target
    h, V, hd = mc.hidden_size, mc.vocab_size, mc.head_dim
    q, kv, i = mc.q_size, mc.kv_size, mc.intermediate_size          # whole
    lq, lkv, li = model.mc.q_size, model.mc.kv_size, model.mc.intermediate_size  # this rank's
    qs, ks, i0 = rank * lq, kv_head_start(mc, rank, n) * hd, rank * li
    v0 = model.vocab_start
    vn = max(0, min(model.embed.shape[0], V - v0))
    t: dict[str, _Target] = {}
    t["model.embed_tokens.weight"] = T(model.embed, 0, (V, h), 0, v0, vn)
    t["model.norm.weight"] = T(model.norm, 0, (h,))
    if not mc.tie_word_embeddings:
        t["lm_head.weight"] = T(model.lm_head.weight, 0, (V, h), 0, v0, vn)
    for j, L in enumerate(model.layers):
        p = f"model.layers.{j}."
        t[p + "input_layernorm.weight"] = T(L.input_norm, 0, (h,))
        if mc.gemma_norms:
            t[p + "post_attention_layernorm.weight"] = T(L.post_attn_norm, 0, (h,))
            t[p + "pre_feedforward_layernorm.weight"] = T(L.post_norm, 0, (h,))
            t[p + "post_feedforward_layernorm.weight"] = T(L.post_mlp_norm, 0, (h,))
        else:
            t[p + "post_attention_layernorm.weight"] = T(L.post_norm, 0, (h,))
        fused = mc.spec.fused_checkpoint   # qkv and gate_up stored already fused (n == 1)
        # (name, row offset in the fused parameter, rows in the checkpoint, first row read, rows read)
        qkv_parts = (("qkv_proj", 0, q + 2 * kv, 0, q + 2 * kv),) if fused else (
            ("q_proj", 0, q, qs, lq), ("k_proj", lq, kv, ks, lkv), ("v_proj", lq + lkv, kv, ks, lkv))
        for name, off, rows, a, size in qkv_parts:
            t[p + f"self_attn.{name}.weight"] = T(L.qkv.weight, off, (rows, h), 0, a, size)
            if L.qkv.bias is not None:
                t[p + f"self_attn.{name}.bias"] = T(L.qkv.bias, off, (rows,), 0, a, size)
        t[p + "self_attn.o_proj.weight"] = T(L.o.weight, 0, (h, q), 1, qs, lq)
        if L.o.bias is not None:
            t[p + "self_attn.o_proj.bias"] = T(L.o.bias, 0, (h,))
        if L.q_norm is not None:
            t[p + "self_attn.q_norm.weight"] = T(L.q_norm, 0, (hd,))
            t[p + "self_attn.k_norm.weight"] = T(L.k_norm, 0, (hd,))
        if L.moe is not None:
            t.update(_expert_targets(L.moe, mc, p))
            continue
        if fused:
            t[p + "mlp.gate_up_proj.weight"] = T(L.gate_up.weight, 0, (2 * i, h))
        else:
            t[p + "mlp.gate_proj.weight"] = T(L.gate_up.weight, 0, (i, h), 0, i0, li)
            t[p + "mlp.up_proj.weight"] = T(L.gate_up.weight, li, (i, h), 0, i0, li)
        t[p + "mlp.down_proj.weight"] = T(L.down.weight, 0, (h, i), 1, i0, li)
        if L.gate_up.bias is not None:
            t[p + "mlp.gate_proj.bias"] = T(L.gate_up.bias, 0, (i,), 0, i0, li)
            t[p + "mlp.up_proj.bias"] = T(L.gate_up.bias, li, (i,), 0, i0, li)
            t[p + "mlp.down_proj.bias"] = T(L.down.bias, 0, (h,))
    return t


def _expert_targets(moe: SparseMoE, mc: ModelConfig, p: str) -> dict[str, _Target]:
    """One tensor per expert and projection, stacked: gate and up into w13[e], down into w2[e],
    under the names the family declares (spec/families.py)."""
    i, h = mc.moe_intermediate_size, mc.hidden_size
    module, gate, up, down = mc.spec.expert_tensors
    pre = f"{p}{module}."
    t = {pre + "gate.weight": _Target(moe.gate.weight, 0, (mc.num_experts, h))}
    for e in range(mc.num_experts):
        x = f"{pre}experts.{e}."
        t[x + gate + ".weight"] = _Target(moe.w13.data[e], 0, (i, h))
        t[x + up + ".weight"] = _Target(moe.w13.data[e], i, (i, h))
        t[x + down + ".weight"] = _Target(moe.w2.data[e], 0, (h, i))
    return t


@torch.inference_mode()
def load_safetensors(model: LlamaModel, mc: ModelConfig, model_dir: Path) -> None:
    from safetensors import safe_open

    tp = model.tp
    targets: dict = _targets(model, mc, tp.rank, tp.world) if tp is not None else _targets(model, mc)
    loaders, optional = fp8_loaders(model, targets)   # FP8 weights, their scales, KV scales
    targets.update(loaders)
    seen: set[str] = set()
    unknown: list[str] = []
    for f in checkpoint_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if _IGNORED.search(name):
                        continue
                    if name == "lm_head.weight" and mc.tie_word_embeddings:
                        continue
                    tgt = targets.get(name)
                    if tgt is None:
                        unknown.append(name)
                        continue
                    if callable(tgt):
                        tgt(sf.get_tensor(name), f.name)
                        seen.add(name)
                        continue
                    sl = sf.get_slice(name)
                    shape = tuple(sl.get_shape())
                    if shape != tgt.shape:
                        raise EngineError(f"{f.name}: tensor {name} has shape {shape}, "
                                          f"config.json implies {tgt.shape}")
                    a = tgt.start
                    b = a + (tgt.size if tgt.size is not None else shape[tgt.dim])
                    src = sl[a:b] if tgt.dim == 0 else sl[:, a:b]
                    if mc.gemma_norms and _NORM.search(name):
                        src = src.float() + 1.0   # Gemma scales by 1 + w
                    tgt.param.data[tgt.off:tgt.off + src.shape[0]].copy_(src.to(tgt.param.dtype))
                    seen.add(name)
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types
            raise EngineError(f"{f}: cannot read safetensors file ({type(exc).__name__}: {exc})") from None
    if unknown:
        raise EngineError(f"{model_dir}: checkpoint holds tensors this {mc.architecture} does not have "
                          f"(wrong architecture in config.json?): {', '.join(sorted(unknown)[:5])}"
                          + (" …" if len(unknown) > 5 else ""))
    missing = sorted(set(targets) - seen - optional)
    if missing:
        raise EngineError(f"{model_dir}: checkpoint is missing {len(missing)} tensor(s): "
                          f"{', '.join(missing[:5])}" + (" …" if len(missing) > 5 else ""))


@torch.inference_mode()
def init_dummy(model: LlamaModel, seed: int) -> None:
    """Random weights on the model's device: N(0, 0.02) matrices, unit norms, zero biases
    (FP8 projections: the same, quantized)."""
    g = torch.Generator(device=model.embed.device)
    g.manual_seed(seed)
    init_dummy_fp8(model, g)
    for name, p in model.named_parameters():
        if p.element_size() == 1:   # FP8 weights, filled above
            continue
        if p.dim() == 1:
            if "bias" in name:
                p.zero_()
            else:
                p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)


def build_model(mc: ModelConfig, model_dir: Path, load_format: str, dtype: torch.dtype,
                device: torch.device, seed: int = 0, quant: QuantConfig | None = None,
                tp=None) -> LlamaModel:
    """The model (or, with tp, this rank's shard of it) with its weights."""
    try:
        model = LlamaModel(mc, dtype, device, quant, tp)
    except torch.OutOfMemoryError:
        raise EngineError(f"the model's weights do not fit on {device}") from None
    model.eval()
    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        load_safetensors(model, mc, Path(model_dir))
    return model
