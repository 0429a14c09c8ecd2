"""engine.config against a config-only model folder: real weights must be there,
unless the engine is told to use dummy weights (benchmarks), when doctor sizes the
weights from config.json instead."""

from __future__ import annotations

import json

from test_checks_helpers import h200

from zerod.checks import DoctorConfig, run_checks
from zerod.checks import probe_model
from zerod.engine.demo import write_tokenizer

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False}


def _check(tmp_path, **engine):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    write_tokenizer(tmp_path)
    cfg = DoctorConfig.from_dict({}, engine={"model": str(tmp_path), **engine})
    facts = h200()
    probe_model.probe(facts, cfg.model, cfg.tokenizer)
    return next(c for c in run_checks(facts, cfg, only=["engine.config"]).checks)


def test_config_only_folder_fails_without_dummy(tmp_path):
    c = _check(tmp_path)
    assert c.status == "fail"
    assert "no model.safetensors or sharded safetensors index found" in c.message   # the loader's words
    assert "--load-format dummy" in c.remediation


def test_a_folder_without_a_tokenizer_fails_as_serve_does(tmp_path):
    (tmp_path / "tok").mkdir()
    c = _check(tmp_path, load_format="dummy", tokenizer=str(tmp_path / "tok"))
    assert c.status == "fail" and "no tokenizer.json (zerod reads fast-tokenizer files only)" in c.message
    assert _check(tmp_path, load_format="dummy").status == "pass"     # the model's own


def test_dummy_weights_are_sized_from_the_config(tmp_path):
    c = _check(tmp_path, load_format="dummy", max_model_len=8192)
    assert c.status == "pass", c.message
    # 8.03 B parameters in bf16: about 15 GiB of weights
    assert "weights 15.0 GiB" in c.message


def test_an_engine_flag_the_engine_refuses_fails_in_its_words(tmp_path):
    c = _check(tmp_path, load_format="dummy", tensor_parallel_size=0)
    assert c.status == "fail" and "tensor_parallel_size must be >= 1, got 0" in c.message
    c = _check(tmp_path, load_format="dummy", block_size="16")   # a string, not a number
    assert c.status == "fail" and "invalid engine config" in c.message


def test_a_model_for_another_engine_is_not_judged_by_zerods(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA3_8B, architectures=["DeepseekV3ForCausalLM"])))
    facts = h200()
    probe_model.probe(facts, str(tmp_path))
    zerod = DoctorConfig.from_config({"engine": {"model": str(tmp_path)}})
    vllm = DoctorConfig.from_config({"daemon": {"engine": "vllm"}, "engine": {"model": str(tmp_path)}})
    [mine] = run_checks(facts, zerod, only=["engine.config"]).checks
    [theirs] = run_checks(facts, vllm, only=["engine.config"]).checks
    assert mine.status == "fail" and "unsupported architecture 'DeepseekV3ForCausalLM'" in mine.message
    assert theirs.status == "skip" and 'engine = "vllm"' in theirs.message
