"""Safetensors (single or sharded with model.safetensors.index.json) into LlamaModel (experts
stacked per layer into w13 / w2, see moe.py); `load_format="dummy"` fills random weights
directly on the device. FP8 projections load through quant/loading.py's entries (weights,
scales, KV scales).

A broken checkpoint (unreadable file, missing or misshapen tensor, unknown tensor name,
index naming a missing shard) raises EngineError naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .config import EngineError
from .hf_config import ModelConfig
from .model import LlamaModel
from .moe import SparseMoE
from .quant.config import QuantConfig
from .quant.loading import fp8_loaders, init_dummy_fp8

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NORM = re.compile(r"(norm|layernorm)\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def checkpoint_files(model_dir: Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"{index}: broken index file ({exc})") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise EngineError(f"{index}: names shard(s) that do not exist: {', '.join(missing)}")
        return [d / f for f in files]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if found:
        return found
    if list(d.glob("*.bin")) or list(d.glob("*.pt")):
        raise EngineError(f"{d}: only PyTorch .bin/.pt weights found; zerod loads safetensors only")
    raise EngineError(f"{d}: no model.safetensors or sharded safetensors index found "
                      f"(use load_format='dummy' for random weights)")


def _targets(model: LlamaModel, mc: ModelConfig) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (parameter, row offset, rows) in the fused layout."""
    t: dict[str, tuple[torch.Tensor, int, int]] = {}
    t["model.embed_tokens.weight"] = (model.embed, 0, mc.vocab_size)
    t["model.norm.weight"] = (model.norm, 0, mc.hidden_size)
    if not mc.tie_word_embeddings:
        t["lm_head.weight"] = (model.lm_head.weight, 0, mc.vocab_size)
    q, kv, i = mc.q_size, mc.kv_size, mc.intermediate_size
    for n, L in enumerate(model.layers):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = (L.input_norm, 0, mc.hidden_size)
        if mc.gemma_norms:
            t[p + "post_attention_layernorm.weight"] = (L.post_attn_norm, 0, mc.hidden_size)
            t[p + "pre_feedforward_layernorm.weight"] = (L.post_norm, 0, mc.hidden_size)
            t[p + "post_feedforward_layernorm.weight"] = (L.post_mlp_norm, 0, mc.hidden_size)
        else:
            t[p + "post_attention_layernorm.weight"] = (L.post_norm, 0, mc.hidden_size)
        fused = mc.family == "phi3"   # checkpoints that store qkv and gate_up already fused
        qkv_parts = (("qkv_proj", 0, q + 2 * kv),) if fused else (
            ("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
        for name, off, rows in qkv_parts:
            t[p + f"self_attn.{name}.weight"] = (L.qkv.weight, off, rows)
            if L.qkv.bias is not None:
                t[p + f"self_attn.{name}.bias"] = (L.qkv.bias, off, rows)
        t[p + "self_attn.o_proj.weight"] = (L.o.weight, 0, mc.hidden_size)
        if L.o.bias is not None:
            t[p + "self_attn.o_proj.bias"] = (L.o.bias, 0, mc.hidden_size)
        if L.q_norm is not None:
            t[p + "self_attn.q_norm.weight"] = (L.q_norm, 0, mc.head_dim)
            t[p + "self_attn.k_norm.weight"] = (L.k_norm, 0, mc.head_dim)
        if L.moe is not None:
            t.update(_expert_targets(L.moe, mc, p))
        elif fused:
            t[p + "mlp.gate_up_proj.weight"] = (L.gate_up.weight, 0, 2 * i)
        else:
            t[p + "mlp.gate_proj.weight"] = (L.gate_up.weight, 0, i)
            t[p + "mlp.up_proj.weight"] = (L.gate_up.weight, i, i)
        if L.moe is None:
            t[p + "mlp.down_proj.weight"] = (L.down.weight, 0, mc.hidden_size)
        if L.moe is None and L.gate_up.bias is not None:
            t[p + "mlp.gate_proj.bias"] = (L.gate_up.bias, 0, i)
            t[p + "mlp.up_proj.bias"] = (L.gate_up.bias, i, i)
            t[p + "mlp.down_proj.bias"] = (L.down.bias, 0, mc.hidden_size)
    return t


def _expert_targets(moe: SparseMoE, mc: ModelConfig, p: str) -> dict[str, tuple[torch.Tensor, int, int]]:
    """One tensor per expert and projection, stacked: gate and up into w13[e], down into w2[e].
    Mixtral names them block_sparse_moe.experts.N.w1 / w3 / w2, Qwen3-MoE mlp.experts.N.gate_proj /
    up_proj / down_proj."""
    i, h = mc.moe_intermediate_size, mc.hidden_size
    if mc.family == "mixtral":
        pre, (gate, up, down) = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        pre, (gate, up, down) = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    t = {pre + "gate.weight": (moe.gate.weight, 0, mc.num_experts)}
    for e in range(mc.num_experts):
        x = f"{pre}experts.{e}."
        t[x + gate + ".weight"] = (moe.w13.data[e], 0, i)
        t[x + up + ".weight"] = (moe.w13.data[e], i, i)
        t[x + down + ".weight"] = (moe.w2.data[e], 0, h)
    return t


@torch.inference_mode()
def load_safetensors(model: LlamaModel, mc: ModelConfig, model_dir: Path) -> None:
    from safetensors import safe_open

    targets: dict = _targets(model, mc)
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
                    src = sf.get_tensor(name)
                    if callable(tgt):
                        tgt(src, f.name)
                        seen.add(name)
                        continue
                    param, off, rows = tgt
                    want = (rows,) + tuple(param.shape[1:])
                    if tuple(src.shape) != want:
                        raise EngineError(f"{f.name}: tensor {name} has shape {tuple(src.shape)}, "
                                          f"config.json implies {want}")
                    if mc.gemma_norms and _NORM.search(name):
                        src = src.float() + 1.0   # Gemma scales by 1 + w
                    param.data[off:off + rows].copy_(src.to(param.dtype), non_blocking=False)
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
                device: torch.device, seed: int = 0, quant: QuantConfig | None = None) -> LlamaModel:
    try:
        model = LlamaModel(mc, dtype, device, quant)
    except torch.OutOfMemoryError:
        raise EngineError(f"the model's weights do not fit on {device}") from None
    model.eval()
    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        load_safetensors(model, mc, Path(model_dir))
    return model
