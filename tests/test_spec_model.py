"""The one model spec (engine/spec/): doctor reads a checkpoint with the engine's own
parser and sizes the KV pool as the engine does. For every family and dtype the spec's
weight bytes equal what the engine allocates, and doctor's page count equals the engine's
plan for the same config and GPU; what `serve` refuses, doctor refuses in the same words."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from test_checks_helpers import edit, edit_gpu0, h200

from zerod.checks import DoctorConfig, probe_model, run_checks
from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.engine import Engine
from zerod.engine.demo import write_tokenizer
from zerod.engine.model.decoder import LlamaModel
from zerod.engine.model.loader import build_model
from zerod.engine.spec.families import FAMILIES
from zerod.engine.spec.hf_config import load_model_config
from zerod.engine.spec.quant import resolve
from zerod.engine.spec.sizing import plan_kv
from zerod.engine.spec.weights import weight_bytes

transformers = pytest.importorskip("transformers")

GiB = 1 << 30
GPU_TOTAL = 2 * GiB      # small, so that a page's worth of weight bytes moves the page count
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# family -> (transformers config class, its fields beyond COMMON)
CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, mlp_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(pad_token_id=2)),
    "gemma2": ("Gemma2Config", dict(sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=8)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         mlp_only_layers=[0])),
}
ARCH = {f.name: f.architecture for f in FAMILIES}


def checkpoint(d, family: str, **over) -> str:
    """A config-only checkpoint folder (config.json written by transformers, the demo
    tokenizer): the engine runs it with --load-format dummy."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(d) + 16
    cls, kw = CONFIGS[family]
    config = getattr(transformers, cls)(vocab_size=vocab, bos_token_id=0, eos_token_id=1,
                                        **{**COMMON, **kw})
    config.architectures = [ARCH[family]]
    raw = dict(config.to_dict(), **over)
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def allocated_bytes(model: torch.nn.Module) -> int:
    """Every tensor the model holds once (a tied head shares the embedding)."""
    seen = {t.data_ptr(): t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()] if t is not None}
    return sum(seen.values())


def gpus(n: int):
    """The H200 snapshot with n GPUs of GPU_TOTAL bytes."""
    gpu = edit_gpu0(h200(), memory={"total": GPU_TOTAL, "free": GPU_TOTAL, "used": 0}).value("nvml.gpus")[0]
    return edit(h200(), "nvml.gpus", [dict(copy.deepcopy(gpu), index=i) for i in range(n)])


def doctor(model_dir: str, n_gpus: int = 1, **engine):
    cfg = DoctorConfig.from_dict({}, engine={"model": model_dir, "load_format": "dummy", **engine})
    facts = gpus(n_gpus)
    probe_model.probe(facts, model_dir)
    return next(iter(run_checks(facts, cfg, only=["engine.config"]).checks))


CASES = [(f, dt, None) for f in CONFIGS for dt in ("bfloat16", "float16", "float32")]
CASES += [(f, "bfloat16", "fp8") for f in ("llama", "qwen2", "phi3", "gemma3")]


@pytest.mark.parametrize("family,dtype,quantization", CASES)
def test_doctor_kv_pages_equal_the_engines_for_the_same_config_and_gpu(tmp_path, family, dtype, quantization):
    d = checkpoint(tmp_path / family, family)
    engine = {"dtype": dtype} | ({"quantization": quantization} if quantization else {})
    c = doctor(d, **engine)
    assert c.status == "pass", c.message
    ev = next(e["value"] for e in c.evidence if e["name"] == "kv_budget")

    # the engine: its model built for this config, then the pool plan_kv sizes from what it leaves
    mc = load_model_config(d)
    quant = resolve(mc.quant, quantization)
    model = build_model(mc, d, "dummy", getattr(torch, dtype), torch.device("cpu"), quant=quant)
    weights = allocated_bytes(model)
    cfg = EngineConfig(model=d, load_format="dummy", **engine)
    plan = plan_kv(cfg, mc, dtype, "cuda", cuda_mem=(GPU_TOTAL - weights, GPU_TOTAL))

    assert weight_bytes(mc, dtype, quant) == weights == ev["weights_bytes"]
    assert (ev["kv_pages"], ev["max_model_len"]) == (plan.num_pages, plan.max_model_len)
    assert ev["kv_bytes_per_token"] * cfg.block_size == plan.page_bytes


@pytest.mark.parametrize("family,tp", [("llama", 2), ("qwen2", 2), ("gemma2", 2), ("qwen3", 4)])
def test_doctor_sizes_one_ranks_shard_under_tensor_parallelism(tmp_path, family, tp):
    d = checkpoint(tmp_path / family, family)
    c = doctor(d, tp, dtype="bfloat16", tensor_parallel_size=tp)
    assert c.status == "pass", c.message
    ev = next(e["value"] for e in c.evidence if e["name"] == "kv_budget")

    # rank 0's shard as the engine builds it (every rank holds as many bytes: the vocabulary
    # rows are padded alike); the group only needs its rank and size to be built
    mc = load_model_config(d)
    model = LlamaModel(mc, torch.bfloat16, torch.device("cpu"), tp=SimpleNamespace(rank=0, world=tp))
    weights = allocated_bytes(model)
    cfg = EngineConfig(model=d, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp)
    plan = plan_kv(cfg, mc, "bfloat16", "cuda", cuda_mem=(GPU_TOTAL - weights, GPU_TOTAL))

    assert weight_bytes(mc, "bfloat16", None, tp) == weights == ev["weights_bytes"]
    assert weights < weight_bytes(mc, "bfloat16")
    assert (ev["kv_pages"], ev["max_model_len"]) == (plan.num_pages, plan.max_model_len)


REFUSED = [
    ("llama", dict(architectures=["GPT2LMHeadModel"]), {}, "unsupported architecture 'GPT2LMHeadModel'"),
    ("llama", dict(partial_rotary_factor=0.5), {}, "partial_rotary_factor 0.5 is not supported"),
    ("llama", dict(architectures="LlamaForCausalLM"), {}, "unsupported architecture 'llama'"),  # not a list
    ("llama", dict(num_attention_heads=0), {}, "sizes must be positive"),
    ("llama", dict(num_attention_heads=0, head_dim=None), {}, "missing or invalid field"),
    ("llama", dict(rms_norm_eps="tiny"), {}, "a field has a value the engine cannot read"),
    ("llama", dict(quantization_config={"quant_method": "awq"}), {}, "'awq' is not supported"),
    ("llama", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), {},
     "does not divide into the checkpoint's 128x128 weight blocks"),
    ("llama", dict(quantization_config={"quant_method": "fp8",
                                        "ignored_layers": ["model.layers.0.self_attn.q_proj"]}), {},
     "quantization ignores model.layers.0.self_attn.q_proj but not"),
    ("mixtral", {}, {"quantization": "fp8"}, "MixtralForCausalLM: FP8 weights for mixtures of experts"),
    ("qwen3_moe", {}, {"tensor_parallel_size": 2}, "Qwen3MoeForCausalLM: --tensor-parallel-size > 1"),
    ("phi3", {}, {"tensor_parallel_size": 2}, "not supported for Phi-3 / Phi-4"),
    ("llama", {}, {"tensor_parallel_size": 3}, "must divide num_attention_heads"),
]


@pytest.mark.parametrize("family,config,engine,words", REFUSED)
def test_doctor_refuses_what_serve_refuses_in_its_words(tmp_path, monkeypatch, family, config, engine, words):
    d = checkpoint(tmp_path / family, family, **config)
    # a refused engine's host-side warm-up (chat template, xgrammar) has nothing to show here
    monkeypatch.setattr(Engine, "_warm_host_side", lambda self: None)
    with pytest.raises(EngineError, match=words) as served:
        Engine(EngineConfig(model=d, load_format="dummy", device="cpu", kv_pages=16, **engine))
    c = doctor(d, **engine)
    assert c.status == "fail" and str(served.value) in c.message, (c.message, str(served.value))


def test_doctor_refuses_more_ranks_than_gpus_as_serve_does(tmp_path):
    d = checkpoint(tmp_path / "llama", "llama")
    c = doctor(d, 1, tensor_parallel_size=2)
    assert c.status == "fail" and "--tensor-parallel-size 2 needs 2 GPUs; this process sees 1" in c.message


def test_doctor_names_an_explicit_context_the_pool_cannot_hold(tmp_path):
    d = checkpoint(tmp_path / "llama", "llama", max_position_embeddings=1 << 24)
    c = doctor(d, max_model_len=1 << 24)
    assert c.status == "fail" and "less than one 16777216-token sequence" in c.message
    # derived from the model, the engine caps it to the pool instead: a warning
    c = doctor(d)
    assert c.status == "warn" and "capped to" in c.message
