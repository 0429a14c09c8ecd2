"""Sliding-window models served past their window (Mistral with sliding_window; Qwen2
with use_sliding_window on the layers from max_window_layers on): attention limited to
the window, logits and greedy output equal transformers' eager. Where every layer slides
(Mistral) a request holds only a ring of pages, the window plus one step's chunk."""

from __future__ import annotations

import threading

import pytest

from families_support import (check_greedy_batched_and_alone, check_logits, hf_checkpoint,
                              hf_greedy, prompts, reference)
from zerod.engine.demo import generate
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams
from zerod.engine.spec.hf_config import load_model_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers as the reference

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
              sliding_window=8)
# name -> (config class, model class, config fields), as tests/test_families_gpu.py reuses them
MODELS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", COMMON),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, max_window_layers=1, tie_word_embeddings=True, **COMMON)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def sliding(request, tmp_path_factory):
    cfg_cls, model_cls, kw = MODELS[request.param]
    d = hf_checkpoint(tmp_path_factory.mktemp(request.param), cfg_cls, model_cls, **kw)
    return request.param, d, *reference(d)


def test_windows_per_layer_and_context_not_capped(sliding):
    family, d, *_ = sliding
    mc = load_model_config(d)
    assert mc.layer_windows == ([8, 8] if family == "mistral" else [0, 8])
    eng = Engine(EngineConfig(model=str(d), block_size=4, kv_pages=200))
    assert eng.max_model_len == 512        # the model's length, not the 8-token window


def test_greedy_agrees_with_transformers(sliding):
    family, d, m, ps, ref = sliding
    check_greedy_batched_and_alone(d, ps, ref)


def test_logits_match_transformers(sliding):
    family, d, m, ps, ref = sliding
    check_logits(d, m, ps)


def test_long_prompt_holds_only_the_window(sliding):
    """A prompt 12x the window: output equals transformers', and while it runs the pool
    lends it the ring (8-token window + 16-token chunk over 4-token pages: 7 pages), not
    the 28 pages of its context. Qwen2 here has a global layer: it keeps every page."""
    family, d, m, *_ = sliding
    prompt = prompts(m.config.vocab_size)[-1] * 2 + [7] * 6        # 100 tokens
    want = hf_greedy(m, [prompt])[0]
    eng = Engine(EngineConfig(model=str(d), block_size=4, kv_pages=200, max_num_batched_tokens=16,
                              max_prefill_tokens_idle=16))
    eng.start()
    held: list[int] = []
    try:
        total = eng.stats().kv_pages_total
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got: list[int] = []
        done = threading.Event()

        def on_output(o):
            held.append(total - eng.stats().kv_pages_free)
            got.extend(o.token_ids)
            if o.finished:
                done.set()

        eng.submit(prompt, sp, on_output)
        assert done.wait(60)
        again = generate(eng, [prompt], sp)[0]        # the same prompt: a prefix-cache candidate
        stats = eng.stats()
        hits = eng.scheduler.cache.stats.hits
    finally:
        eng.shutdown(0)
    assert got == want == again["token_ids"]
    assert max(held) == (7 if family == "mistral" else 28)
    assert stats.kv_pages_free == stats.kv_pages_total
    if family == "mistral":
        assert hits == 0                               # ring pages are never shared
