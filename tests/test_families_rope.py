"""RoPE scalings against transformers' own rope init functions and rotary modules."""

from __future__ import annotations

import pytest
import torch

from families_support import (check_greedy_batched_and_alone, hf_checkpoint, hf_greedy,
                              hf_model, prompts)
from zerod.engine.config import EngineError
from zerod.engine.spec.hf_config import parse_model_config
from zerod.engine.model.rope import cos_sin_cache, inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

pytestmark = pytest.mark.slow  # transformers as the reference

HEAD_DIM = 32
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + 0.3 * i for i in range(HEAD_DIM // 2)]},
}


def _configs(name):
    """(transformers LlamaConfig, our ModelConfig) for one scaling, max_position 512."""
    rp = dict(SCALINGS[name], rope_theta=10000.0)
    hf = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM,
                                  max_position_embeddings=512, rope_parameters=rp)
    raw = dict(hf.to_dict(), architectures=["LlamaForCausalLM"])
    return hf, parse_model_config(raw)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 100, 300, 1000])
def test_inv_freq_and_attention_factor_equal_transformers(name, seq_len):
    hf, mc = _configs(name)
    want, want_attn = ROPE_INIT_FUNCTIONS[mc.rope_scaling["rope_type"]](hf, "cpu", seq_len=seq_len)
    got, attn = inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling, mc.max_position_embeddings, seq_len)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert attn == pytest.approx(want_attn, rel=1e-12)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_cache_equals_transformers_rotary_embedding(name):
    """Within the lengths where transformers' values do not depend on the sequence's own
    length (docs in engine/model/rope.py), the cache rows equal its rotary module's cos/sin."""
    hf, mc = _configs(name)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    n = mc.rope_scaling.get("original_max_position_embeddings", 512)
    cache = cos_sin_cache(mc, 512, torch.float32, "cpu")
    pos = torch.arange(n)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    h = HEAD_DIM // 2
    torch.testing.assert_close(cache[:n, :h], cos[0, :, :h], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache[:n, h:], sin[0, :, :h], atol=1e-6, rtol=1e-5)
    if name == "longrope":  # past the original length: the long factors, as transformers uses there
        pos = torch.arange(512)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
        torch.testing.assert_close(cache[n:, :h], cos[0, n:, :h], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "su2", "factor": 2.0}, r"rope scaling 'su2' is not supported \(default, linear"),
    ({"rope_type": "yarn"}, "'yarn' needs factor"),
    ({"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}, "long_factor has 1 values"),
    ("linear", "rope_scaling must be an object"),
])
def test_bad_scaling_refused_with_a_clear_error(bad, match):
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=128, num_attention_heads=4,
               num_hidden_layers=1, intermediate_size=64, vocab_size=100, head_dim=HEAD_DIM,
               rope_scaling=bad)
    with pytest.raises(EngineError, match=match):
        parse_model_config(raw)


@pytest.mark.parametrize("name", ["yarn", "dynamic", "linear"])
def test_scaled_llama_greedy_agrees_with_transformers(name, tmp_path):
    rp = dict(SCALINGS[name], rope_theta=10000.0)
    if name == "yarn":
        rp["original_max_position_embeddings"] = 32   # the prompts run past it
    d = hf_checkpoint(tmp_path, "LlamaConfig", "LlamaForCausalLM", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=rp)
    m = hf_model(d)
    ps = prompts(m.config.vocab_size)[::2]
    check_greedy_batched_and_alone(d, ps, hf_greedy(m, ps), max_model_len=128)
