"""Probe the model the engine is configured to serve: its config.json and
generation_config.json as written (engine.config reads them with the engine's own model
spec) and the safetensors weights the loader would read."""

from __future__ import annotations

import os

from zerod.engine.config import EngineError
from zerod.engine.spec.hf_config import read_config_json, read_generation_config  # torch-free

from .facts import Facts


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
        cfg = read_config_json(model)
    except EngineError as exc:
        facts.put("engine.model", {"model": model, "exists": True, "config_error": str(exc)}, cfg_path)
        return
    weights = 0
    for name in os.listdir(model):
        if name.endswith(".safetensors"):   # the only weights the engine loads
            try:
                weights += os.path.getsize(os.path.join(model, name))
            except OSError:
                pass
    facts.put("engine.model", {
        "model": model,
        "exists": True,
        "config": cfg,
        "generation_config": read_generation_config(model),
        "safetensors_bytes": weights,
    }, cfg_path)
