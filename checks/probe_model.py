"""Probe the model the engine is configured to serve: its config.json and
generation_config.json as written (engine.config reads them with the engine's own model
spec), and whether the loader would find its safetensors weights and its tokenizer."""

from __future__ import annotations

import os

from zerod.engine.config import EngineError
# torch-free: the engine's own reading of a checkpoint folder
from zerod.engine.spec.checkpoint import checkpoint_files, tokenizer_file
from zerod.engine.spec.hf_config import read_config_json, read_generation_config

from .facts import Facts


def probe(facts: Facts, model: str | None, tokenizer: str | None = None) -> None:
    """tokenizer: [engine] tokenizer, the folder of tokenizer.json when not the model's."""
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
        cfg = read_config_json(model)
    except EngineError as exc:
        facts.put("engine.model", {"model": model, "exists": True, "config_error": str(exc)}, cfg_path)
        return
    facts.put("engine.model", {
        "model": model,
        "exists": True,
        "config": cfg,
        "generation_config": read_generation_config(model),
        # what the loader and the tokenizer would refuse of the folder, in their words
        "weights_error": _refusal(checkpoint_files, model),
        "tokenizer_error": _refusal(tokenizer_file, tokenizer or model),
    }, cfg_path)


def _refusal(read, path: str) -> str | None:
    try:
        read(path)
    except EngineError as exc:
        return str(exc)
    return None
