"""Sizing: doctor and the engine size the KV cache with one formula; the dtype policy; the
CUDA page count and the max_model_len cap; building an engine changes no global state."""

from __future__ import annotations

import pytest
from test_checks_helpers import h200

from zerod.checks import DoctorConfig, probe_model, run_checks
from zerod.engine.model import ops
from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.demo import demo_model_dir, make_checkpoint
from zerod.engine.core.engine import Engine
from zerod.engine.spec.hf_config import load_model_config
from zerod.engine.spec.sizing import kv_bytes_per_token, plan_kv, serving_dtype


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    try:
        yield demo_model_dir()
    finally:
        mp.undo()


def _doctor_kv(model_dir, dtype="auto") -> dict:
    cfg = DoctorConfig(model=str(model_dir), dtype=dtype)
    facts = h200()
    probe_model.probe(facts, cfg.model)
    c = next(iter(run_checks(facts, cfg, only=["engine.config"]).checks))
    assert c.status == "pass", c.message
    return next(e["value"] for e in c.evidence if e["name"] == "kv_budget")


def test_doctor_and_engine_agree_on_kv_bytes_per_token_for_the_demo(demo_dir):
    # doctor sizes for a GPU: auto serves the demo's float32 checkpoint in bfloat16 there
    doc = _doctor_kv(demo_dir)
    assert doc["dtype"] == "bfloat16" == serving_dtype("auto", "float32", "cuda")
    e = Engine(EngineConfig(model=str(demo_dir), dtype="bfloat16", kv_pages=4, max_model_len=32))
    kv = e.pool.kv                         # [layers, 2, pages, page, Hk, D] as allocated
    per_token = kv.element_size() * kv.numel() // (kv.shape[2] * kv.shape[3])
    assert doc["kv_bytes_per_token"] == per_token == 2 * 4 * 2 * 32 * 2   # K+V, 4 layers, 2 heads of 32, bf16
    # an explicit dtype is what both use
    assert _doctor_kv(demo_dir, "float32")["kv_bytes_per_token"] == 2 * per_token


def test_dtype_policy():
    assert serving_dtype("auto", "bfloat16", "cpu") == "float32"
    assert serving_dtype("auto", "float16", "cuda") == "float16"
    assert serving_dtype("auto", "float32", "cuda") == "bfloat16"
    assert serving_dtype("auto", None, "cuda") == "bfloat16"
    assert serving_dtype("fp16", "bfloat16", "cpu") == "float16"
    with pytest.raises(EngineError, match="unsupported dtype"):
        serving_dtype("auto", "float8_e4m3fn", "cuda")
    assert kv_bytes_per_token(32, 8, 128, "torch.bfloat16") == 131072   # Llama-3-8B: 128 KiB


def test_cuda_pages_and_the_context_cap(demo_dir):
    mc = load_model_config(demo_dir)
    gib = 1 << 30
    pb = 16 * kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, "bfloat16")
    plan = plan_kv(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_idle=64),
                   mc, "bfloat16", "cuda", cuda_mem=(40 * gib, 80 * gib))
    # 0.9 x 80 GiB, less the 40 GiB in use, less the headroom (1 GiB + a little activation)
    assert plan.page_bytes == pb
    assert 30 * gib // pb < plan.num_pages < 31 * gib // pb
    assert plan.max_model_len == mc.max_position_embeddings
    # a pool smaller than the model's context caps max_model_len; asked for explicitly, it is refused
    small = plan_kv(EngineConfig(kv_pages=9, block_size=16), mc, "bfloat16", "cuda")
    assert small.max_model_len == 8 * 16
    with pytest.raises(EngineError, match="max_model_len 1024 needs 64 KV pages, the pool has 8"):
        plan_kv(EngineConfig(kv_pages=9, block_size=16, max_model_len=1024), mc, "bfloat16", "cuda")
    with pytest.raises(EngineError, match="not enough GPU memory"):
        plan_kv(EngineConfig(), mc, "bfloat16", "cuda", cuda_mem=(2 * gib, 80 * gib))


def test_a_head_dim_the_kernels_cannot_take_is_this_models_choice_alone(tmp_path):
    make_checkpoint(tmp_path / "odd", "llama", hidden_size=96, num_heads=4, num_kv_heads=2)  # head_dim 24
    make_checkpoint(tmp_path / "even", "llama")                                               # head_dim 16
    before = set(ops.DISABLED)
    odd = Engine(EngineConfig(model=str(tmp_path / "odd"), kv_pages=20, max_model_len=32))
    even = Engine(EngineConfig(model=str(tmp_path / "even"), kv_pages=20, max_model_len=32))
    assert ops.DISABLED == before
    assert not odd.model.ops.head_dim_kernels and odd.model.ops.rope_write_kv is ops.rope_write_kv_reference
    assert even.model.ops.head_dim_kernels and even.model.ops.decode_attention is ops.decode_attention
    assert even.model.ops.has_kernel("decode_attention") == ops.has_kernel("decode_attention")
    assert not odd.model.ops.has_kernel("decode_attention")
