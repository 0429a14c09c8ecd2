"""Loading: sharded safetensors, dummy weights, and clear refusals of what cannot run."""

from __future__ import annotations

import json
import shutil

import pytest

from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.request import SamplingParams
from zerod.engine.demo import generate, make_checkpoint, write_tokenizer
from zerod.engine.core.engine import Engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    make_checkpoint(d, "qwen2", seed=5)
    return d


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300]]


def _run(d, **kw):
    e = Engine(EngineConfig(model=str(d), kv_pages=64, **kw))
    e.start()
    try:
        return [r["token_ids"] for r in generate(e, PROMPTS, GREEDY)]
    finally:
        e.shutdown(0)


def test_sharded_equals_single(ckpt, tmp_path):
    d = tmp_path / "sharded"
    make_checkpoint(d, "qwen2", seed=5, shards=3)
    assert (d / "model.safetensors.index.json").exists() and not (d / "model.safetensors").exists()
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    assert _run(d) == _run(ckpt)


def test_bf16_checkpoint_runs_in_fp32_and_bf16(tmp_path):
    d = tmp_path / "bf16"
    make_checkpoint(d, "llama", dtype="bfloat16", seed=2)
    a = _run(d)
    b = _run(d, dtype="bfloat16")
    assert len(a[0]) == len(b[0]) == 10


def test_dummy_from_config_only_dir(tmp_path):
    d = tmp_path / "dummy"
    write_tokenizer(d)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96,
           "vocab_size": 1000, "max_position_embeddings": 256, "rope_theta": 500000.0,
           "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    e = Engine(EngineConfig(model=str(d), load_format="dummy", kv_pages=40))
    assert e.vocab_size == 1000 and e.max_model_len == 256
    e.start()
    try:
        r = generate(e, [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True))[0]
        assert len(r["token_ids"]) == 8 and isinstance(r["text"], str)   # ids >= tokenizer vocab decode to ""
    finally:
        e.shutdown(0)
    with pytest.raises(EngineError, match="safetensors"):
        Engine(EngineConfig(model=str(d), kv_pages=40))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_refused(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "gpt2")
    c = json.loads((d / "config.json").read_text())
    c["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(EngineError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        Engine(EngineConfig(model=str(d)))


def test_quantized_checkpoint_refused_naming_the_method(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "awq")
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(EngineError, match="quantization method 'awq' is not supported"):
        Engine(EngineConfig(model=str(d)))


def test_unsupported_rope_scaling_refused(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "mrope")
    c = json.loads((d / "config.json").read_text())
    c["rope_scaling"] = {"rope_type": "mrope", "mrope_section": [16, 24, 24]}
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(EngineError, match="'mrope' is not supported"):
        Engine(EngineConfig(model=str(d)))


def test_missing_tensor_refused(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(ckpt, tmp_path / "missing")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        Engine(EngineConfig(model=str(d)))


def test_wrong_shape_refused(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "shape")
    c = json.loads((d / "config.json").read_text())
    c["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(EngineError, match="has shape"):
        Engine(EngineConfig(model=str(d)))


def test_corrupt_file_refused(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(EngineError, match="cannot read safetensors"):
        Engine(EngineConfig(model=str(d)))


def test_index_with_missing_shard_refused(tmp_path):
    d = tmp_path / "shards"
    make_checkpoint(d, "llama", shards=2)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(EngineError, match="shard"):
        Engine(EngineConfig(model=str(d)))


def test_no_config_and_bad_dir(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(EngineError, match="config.json"):
        Engine(EngineConfig(model=str(tmp_path)))
    with pytest.raises(EngineError):
        EngineConfig(dtype="int3")
    with pytest.raises(EngineError):
        EngineConfig(block_size=12)


def test_max_model_len_beyond_pool_refused(ckpt):
    with pytest.raises(EngineError, match="max_model_len"):
        Engine(EngineConfig(model=str(ckpt), kv_pages=4, max_model_len=256))
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=5))          # default: capped to the pool
    assert e.max_model_len == 4 * 16


def test_an_engine_refused_after_its_build_leaves_no_step_thread(ckpt, monkeypatch):
    """A start that fails once the device side is built (here: its metrics) raises the
    error and leaves nothing running behind it, so a retry in the same process starts clean."""
    import threading

    from zerod.engine.core import engine as engine_mod

    def broken(*a, **kw):
        raise EngineError("metrics registry refused")

    before = {t for t in threading.enumerate() if t.name == "zerod-step"}
    monkeypatch.setattr(engine_mod, "EngineMetrics", broken)
    with pytest.raises(EngineError, match="metrics registry refused"):
        Engine(EngineConfig(model=str(ckpt), kv_pages=64))
    left = {t for t in threading.enumerate() if t.name == "zerod-step" and t.is_alive()} - before
    assert not left
    monkeypatch.undo()
    assert _run(ckpt)[0]                       # the same process serves afterwards


def test_demo_model_created_once_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    e = Engine(EngineConfig(model="demo", kv_pages=64))
    d = tmp_path / "zerod" / "demo"
    assert (d / "config.json").exists() and "meaningless" in (d / "README.txt").read_text()
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert e.model_name == "demo"
    prompt = e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]),
                                add_special_tokens=False)
    e.start()
    try:
        r = generate(e, [prompt], SamplingParams(max_tokens=8, temperature=0.7, seed=1))[0]
        assert r["finish_reason"] in ("length", "stop") and r["token_ids"]
    finally:
        e.shutdown(0)
    Engine(EngineConfig(model="demo", kv_pages=64))
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp   # not rebuilt
