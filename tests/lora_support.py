"""Shared by tests/test_lora_*.py: a tiny transformers Llama, PEFT adapters on it with
random non-zero weights (saved in PEFT's own format), PEFT's merged model as the
reference, and a generate helper that names an adapter per prompt."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from families_support import hf_checkpoint, hf_model, logprob_errors  # noqa: F401 (logprob_errors re-exported)

LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig fields: every projection, attention only (rslora), the MLP only
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def base_checkpoint(d: Path) -> Path:
    return hf_checkpoint(d, "LlamaConfig", "LlamaForCausalLM", seed=11, **LLAMA)


def make_adapter(base_dir: Path, out: Path, seed: int, **lora_cfg):
    """Save a PEFT adapter with random A and B (B non-zero, unlike PEFT's init) into out;
    returns PEFT's merged model (fp32), the reference."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(base_dir), LoraConfig(lora_dropout=0.0, **lora_cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(out))
    return model.merge_and_unload().eval()


def base_and_adapters(d: Path) -> tuple[Path, dict[str, Path], dict]:
    """The tiny base checkpoint under d, every ADAPTERS entry written beside it, and the
    reference models (fp32, CPU): (base, {name: path}, {None: base, name: PEFT's merge})."""
    base = base_checkpoint(d / "base")
    paths, models = {}, {None: hf_model(base)}
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        paths[name] = d / name
        models[name] = make_adapter(base, paths[name], seed, **cfg)
    return base, paths, models


def generate(engine, jobs: list[tuple[list[int], str | None]], params, timeout: float = 120.0
             ) -> list[dict]:
    """Submit every (prompt, adapter or None) at once and wait for all of them."""
    res = [dict(token_ids=[], logprobs=[], finish_reason=None, error=None) for _ in jobs]
    left = [len(jobs)]
    cv = threading.Condition()

    def cb_for(i):
        def cb(o):
            res[i]["token_ids"] += o.token_ids
            res[i]["logprobs"] += o.logprobs or []
            if o.finished:
                res[i]["finish_reason"], res[i]["error"] = o.finish_reason, o.error
                with cv:
                    left[0] -= 1
                    cv.notify_all()
        return cb

    for i, (p, lora) in enumerate(jobs):
        engine.submit(p, params, cb_for(i), lora=lora)
    with cv:
        assert cv.wait_for(lambda: left[0] == 0, timeout=timeout), f"{left[0]} requests did not finish"
    return res
