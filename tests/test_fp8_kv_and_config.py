"""FP8 KV cache (`--kv-cache-dtype fp8`), the flags' validation, refused quantization
methods, the KV sizing shared with doctor, and doctor's engine.config on FP8.

FP8 KV against the model-dtype KV on the CPU's reference path, teacher-forced over a
24-token sequence through prefill, chunked prefill and decode: mean |Δ log p| <= 0.15
over the tokens the reference gives p > 1e-3 (measured ~0.07; e4m3 keeps 3 mantissa bits).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import fp8_support as S
from test_checks_helpers import edit_gpu0, h200
from zerod.checks import DoctorConfig, probe_model, run_checks
from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.demo import write_tokenizer
from zerod.engine.spec.hf_config import parse_model_config
from zerod.engine.spec.sizing import kv_bytes_per_token, plan_kv


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = S.bf16_checkpoint(tmp_path_factory.mktemp("kv") / "float")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return d, S.sequence(vocab)


def _mean(a, b) -> float:
    keep = b.exp() > 1e-3
    return float((a - b).abs()[keep].mean())


def test_fp8_kv_cache_against_model_dtype_kv(base):
    d, seq = base
    ref_eng, eng = S.engine(d), S.engine(d, kv_cache_dtype="fp8")
    try:
        assert eng.pool.kv.dtype == torch.float8_e4m3fn and ref_eng.pool.kv.dtype == torch.float32
        got, ref = S.engine_logprobs(eng, seq), S.engine_logprobs(ref_eng, seq)
    finally:
        eng.shutdown(0)
        ref_eng.shutdown(0)
    assert 0 < _mean(got, ref) <= 0.15


def test_checkpoint_kv_scales_are_read(base, tmp_path):
    d, seq = base
    q = S.write_fp8(d, tmp_path / "kvs", "channel")
    t = load_file(str(q / "model.safetensors"))
    t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    t["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor(0.02)
    save_file(t, str(q / "model.safetensors"))
    eng = S.engine(q, kv_cache_dtype="fp8")
    try:
        L0, L1 = eng.model.layers
        assert (L0.k_scale, L0.v_scale, L1.k_scale, L1.v_scale) == (pytest.approx(0.05), 1.0, 1.0, pytest.approx(0.02))
        assert eng.runner.score_last(seq[:9], 4).isfinite().all()
    finally:
        eng.shutdown(0)


def test_fp8_kv_holds_twice_the_tokens(base):
    d, _ = base
    mc = parse_model_config(json.loads((d / "config.json").read_text()))
    assert kv_bytes_per_token(32, 8, 128, "bfloat16") == 2 * kv_bytes_per_token(32, 8, 128, "fp8_e4m3")
    budget = dict(kv_cache_memory_bytes=1 << 20, max_num_seqs=1024, block_size=16)
    auto = plan_kv(EngineConfig(**budget), mc, "bfloat16", "cpu")
    fp8 = plan_kv(EngineConfig(kv_cache_dtype="fp8", **budget), mc, "bfloat16", "cpu")
    assert fp8.page_bytes * 2 == auto.page_bytes and fp8.num_pages == 2 * auto.num_pages


@pytest.mark.parametrize("field,value", [("kv_cache_dtype", "fp16"), ("quantization", "awq")])
def test_bad_flag_values_are_refused(field, value):
    with pytest.raises(EngineError, match=f"{field} '{value}' is not one of"):
        EngineConfig(**{field: value})


def test_cli_refuses_a_bad_kv_cache_dtype():
    from zerod.engine.cli import serve

    r = CliRunner().invoke(serve, ["--model", "demo", "--kv-cache-dtype", "int8"])
    assert r.exit_code == 2 and "--kv-cache-dtype int8: not served" in r.output
    assert "auto, fp8, fp8_e4m3" in r.output


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors checkpoint with 4-bit int weights is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}}},
     "8-bit int weights"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "block-wise weights need activation_scheme dynamic"),
])
def test_unsupported_quantization_is_refused_naming_it(base, qc, named):
    raw = json.loads((base[0] / "config.json").read_text())
    with pytest.raises(EngineError, match=named):
        parse_model_config(dict(raw, quantization_config=qc))


LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


def _doctor(tmp_path, facts, **engine):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    write_tokenizer(tmp_path)
    cfg = DoctorConfig.from_dict({}, engine={"model": str(tmp_path), "load_format": "dummy",
                                             "max_model_len": 8192, **engine})
    probe_model.probe(facts, cfg.model)
    return next(iter(run_checks(facts, cfg, only=["engine.config"]).checks))


@pytest.mark.parametrize("engine", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}])
def test_doctor_refuses_fp8_below_compute_capability_8_9(tmp_path, engine):
    c = _doctor(tmp_path, edit_gpu0(h200(), cc=[8, 0]), **engine)
    assert c.status == "fail" and "compute capability 8.9" in c.message and "is 8.0" in c.message
    assert "kv_cache_dtype" in c.remediation


def test_doctor_sizes_fp8_kv_at_one_byte(tmp_path):
    auto = _doctor(tmp_path, h200())
    fp8 = _doctor(tmp_path, h200(), kv_cache_dtype="fp8", quantization="fp8")
    assert auto.status == fp8.status == "pass", (auto.message, fp8.message)
    budget = [next(e["value"] for e in c.evidence if e["name"] == "kv_budget") for c in (auto, fp8)]
    assert [b["kv_bytes_per_token"] for b in budget] == [131072, 65536]
    # each layer's projections drop a byte an element and gain a float32 scale an output row;
    # the embedding and the LM head stay bfloat16 (as vLLM keeps them)
    elements = 4096 * (6144 + 4096) + 2 * 14336 * 4096 + 4096 * 14336
    rows = 6144 + 4096 + 2 * 14336 + 4096
    assert budget[0]["weights_bytes"] - budget[1]["weights_bytes"] == 32 * (elements - 4 * rows)
    seqs = [int(c.message.split(" = ")[1].split()[0]) for c in (auto, fp8)]
    assert seqs[1] > 2 * seqs[0]      # half the bytes a token, and 7.5 GiB more room from the weights


def test_doctor_names_an_unsupported_checkpoint_method(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA3_8B, quantization_config={"quant_method": "awq"})))
    cfg = DoctorConfig.from_dict({}, engine={"model": str(tmp_path), "load_format": "dummy"})
    facts = h200()
    probe_model.probe(facts, cfg.model)
    c = next(iter(run_checks(facts, cfg, only=["engine.config"]).checks))
    assert c.status == "fail" and "'awq' is not supported" in c.message
