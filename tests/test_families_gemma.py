"""Gemma 2 and Gemma 3 (text): soft-capping, alternating sliding-window and global layers,
pre- and post-norms, GeGLU, scaled embeddings, query_pre_attn_scalar; token-exact with
transformers (eager attention). Windows of 8 tokens, so every longer prompt and every
decode past it exercises the sliding layers."""

from __future__ import annotations

import pytest

from families_support import check_greedy_batched_and_alone, check_logits, hf_checkpoint, reference
from zerod.engine.config import EngineError
from zerod.engine.spec.hf_config import load_model_config, parse_model_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers as the reference

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
              query_pre_attn_scalar=24, tie_word_embeddings=True)
# 3 sliding layers then a global one; local RoPE base 10000, global 1e6 with linear scaling
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
# name -> (config class, model class, config fields), as tests/test_families_gpu.py reuses them
MODELS = {
    # soft-caps low enough to bite with these weights
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, **COMMON)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention"],
                    rope_parameters=GEMMA3_ROPE, **COMMON)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def gemma(request, tmp_path_factory):
    cfg_cls, model_cls, kw = MODELS[request.param]
    d = hf_checkpoint(tmp_path_factory.mktemp(request.param), cfg_cls, model_cls, **kw)
    return request.param, d, *reference(d)


def test_config_reads_gemma(gemma):
    family, d, *_ = gemma
    mc = load_model_config(d)
    assert mc.family == family and mc.gemma_norms and mc.hidden_act == "gelu_tanh"
    assert mc.attn_scale == pytest.approx(24 ** -0.5)
    if family == "gemma2":
        assert mc.layer_windows == [8, 0, 8, 0] and (mc.attn_softcap, mc.final_softcap) == (2.0, 5.0)
    else:
        assert mc.layer_windows == [8, 8, 8, 0, 8] and mc.qk_norm
        assert (mc.local_rope_theta, mc.rope_theta, mc.rope_scaling["rope_type"]) == (10000.0, 1e6, "linear")


def test_greedy_agrees_with_transformers(gemma):
    family, d, m, ps, ref = gemma
    check_greedy_batched_and_alone(d, ps, ref)


def test_logits_match_transformers(gemma):
    family, d, m, ps, ref = gemma
    check_logits(d, m, ps)


def test_bad_layer_types_refused():
    raw = dict(architectures=["Gemma2ForCausalLM"], hidden_size=64, num_attention_heads=4,
               num_hidden_layers=2, intermediate_size=64, vocab_size=100, sliding_window=8,
               layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(EngineError, match="layer_types must name sliding_attention or full_attention"):
        parse_model_config(raw)
