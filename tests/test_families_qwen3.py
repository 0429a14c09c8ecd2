"""Qwen3 (RMSNorm over each q and k head before RoPE): token-exact with transformers."""

from __future__ import annotations

import pytest

from families_support import check_greedy_batched_and_alone, check_logits, hf_checkpoint, reference
from zerod.engine.spec.hf_config import load_model_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers as the reference


# (config class, model class, config fields), as tests/test_families_gpu.py reuses it
QWEN3 = ("Qwen3Config", "Qwen3ForCausalLM",
         dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=True, rope_theta=1000000.0))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    cfg_cls, model_cls, kw = QWEN3
    d = hf_checkpoint(tmp_path_factory.mktemp("qwen3"), cfg_cls, model_cls, **kw)
    return d, *reference(d)


def test_config_reads_qwen3(qwen3):
    mc = load_model_config(qwen3[0])
    assert (mc.family, mc.qk_norm, mc.head_dim, mc.qkv_bias) == ("qwen3", True, 32, False)


def test_greedy_agrees_with_transformers(qwen3):
    d, m, ps, ref = qwen3
    check_greedy_batched_and_alone(d, ps, ref)


def test_logits_match_transformers(qwen3):
    d, m, ps, ref = qwen3
    check_logits(d, m, ps)
