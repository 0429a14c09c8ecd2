"""Probe the model the engine is configured to serve (its HF config.json and weights)."""

from __future__ import annotations

import json
import os

from zerod.engine.spec.sizing import param_count  # torch-free: the engine's own formula

from .facts import Facts

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


def probe(facts: Facts, model: str | None) -> None:
    if not model:
        facts.fail("engine.model", "no model configured ([engine] model)", "zerod.toml", missing=True)
        return
    if model == "demo":
        facts.put("engine.model", {"model": "demo", "demo": True}, "[engine] model")
        return
    cfg_path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        facts.put("engine.model", {"model": model, "exists": False}, model)
        return
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        facts.put("engine.model", {"model": model, "exists": True, "config_error": str(exc)}, cfg_path)
        return
    text_cfg = cfg.get("text_config", cfg)
    heads = text_cfg.get("num_attention_heads")
    hidden = text_cfg.get("hidden_size")
    weights = 0
    for name in os.listdir(model):
        if name.endswith((".safetensors", ".bin")):
            try:
                weights += os.path.getsize(os.path.join(model, name))
            except OSError:
                pass
    facts.put("engine.model", {
        "model": model,
        "exists": True,
        "architectures": cfg.get("architectures"),
        "num_hidden_layers": text_cfg.get("num_hidden_layers"),
        "num_key_value_heads": text_cfg.get("num_key_value_heads", heads),
        "head_dim": text_cfg.get("head_dim") or (hidden // heads if hidden and heads else None),
        "max_position_embeddings": text_cfg.get("max_position_embeddings"),
        "torch_dtype": text_cfg.get("torch_dtype") or cfg.get("dtype"),
        "weights_bytes": weights,
        "params_estimate": param_count(text_cfg),   # experts counted
        # the checkpoint's quantization (compressed-tensors, fp8, awq, ...); None: unquantized
        "quant_method": (cfg.get("quantization_config") or {}).get("quant_method")
        if isinstance(cfg.get("quantization_config"), dict) else None,
        "quantization_config": cfg.get("quantization_config"),
    }, cfg_path)


def dtype_bytes(dtype: str | None) -> int:
    return _DTYPE_BYTES.get(str(dtype or "bfloat16").replace("torch.", ""), 2)
