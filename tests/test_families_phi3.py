"""Phi-3 / Phi-4 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj tensors, LongRoPE):
token-exact with transformers."""

from __future__ import annotations

import pytest

from families_support import (check_greedy_batched_and_alone, check_logits, hf_checkpoint,
                              hf_greedy, hf_model, prompts, reference)
from zerod.engine.config import EngineError
from zerod.engine.spec.hf_config import load_model_config, parse_model_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers as the reference

HEAD_DIM = 16
PHI3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False, sliding_window=None)
# LongRoPE as Phi-3-128k ships it: original length at the top level, factor 512/64 = 8
# (attention factor > 1). (config class, model class, config fields), as
# tests/test_families_gpu.py reuses it.
PHI3_LONGROPE = ("Phi3Config", "Phi3ForCausalLM", dict(
    PHI3, original_max_position_embeddings=64,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                     "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                     "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]}))


def _phi3(d, **extra):
    return hf_checkpoint(d, "Phi3Config", "Phi3ForCausalLM", **dict(PHI3, **extra))


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    """Every sequence stays within LongRoPE's original 64 tokens, where transformers uses
    the short factors throughout (engine/model/rope.py says why that matters)."""
    d = _phi3(tmp_path_factory.mktemp("phi3"), **PHI3_LONGROPE[2])
    return d, *reference(d)


def test_config_reads_phi3_longrope(phi3_longrope):
    mc = load_model_config(phi3_longrope[0])
    assert mc.family == "phi3"
    assert mc.rope_scaling["rope_type"] == "longrope"
    assert mc.rope_scaling["original_max_position_embeddings"] == 64


def test_greedy_agrees_with_transformers(phi3_longrope):
    d, m, ps, ref = phi3_longrope
    check_greedy_batched_and_alone(d, ps, ref)


def test_logits_match_transformers(phi3_longrope):
    d, m, ps, ref = phi3_longrope
    check_logits(d, m, ps)


def test_plain_rope_phi4_shape_agrees(tmp_path):
    """Phi-4 (14B) is Phi3ForCausalLM with plain RoPE and more kv heads."""
    d = _phi3(tmp_path, num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    m = hf_model(d)
    ps = prompts(m.config.vocab_size)[::2]
    check_greedy_batched_and_alone(d, ps, hf_greedy(m, ps))


def test_partial_rotary_refused_naming_it():
    """Phi-4-mini rotates 3/4 of each head; the engine's RoPE rotates the whole head."""
    raw = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, num_attention_heads=4,
               num_hidden_layers=1, intermediate_size=64, vocab_size=100, partial_rotary_factor=0.75)
    with pytest.raises(EngineError, match="partial_rotary_factor 0.75 is not supported"):
        parse_model_config(raw)
