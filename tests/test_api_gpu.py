"""Issue 13's last parts on a CUDA GPU (skipped without one): prompt logprobs computed in
the prefill step with CUDA graphs captured, and structured outputs whose masks are filled
while the step's forward runs."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("transformers")

from families_support import hf_checkpoint, hf_model
from zerod.engine.demo import generate
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("gpu-api"), "LlamaConfig", "LlamaForCausalLM",
                         hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)


def test_prompt_logprobs_on_the_device_equal_transformers(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="float32", kv_pages=256,
                            block_size=16, max_model_len=256, max_num_seqs=16,
                            max_num_batched_tokens=32, max_prefill_tokens_idle=32))
    e.start()
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (2, 17, 70, 90)]
        res = generate(e, prompts, SamplingParams(max_tokens=2, temperature=0.0,
                                                  prompt_logprobs=3, ignore_eos=True))
    finally:
        e.shutdown(0)
    m = hf_model(ckpt)
    for p, r in zip(prompts, res):
        pl = r["outputs"][0].prompt_logprobs
        assert len(pl) == len(p) and pl[0].logprob is None
        with torch.no_grad():
            ref = torch.log_softmax(m(torch.tensor([p])).logits[0, :-1].float(), -1)
        got = torch.tensor([x.logprob for x in pl[1:]])
        want = ref.gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
        assert [x.top[0][0] for x in pl[1:]] == ref.argmax(-1).tolist()


def test_masked_streams_on_the_device_are_all_valid(ckpt):
    from zerod.engine.sampling.structured import GrammarSpec

    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                             "b": {"enum": ["x", "y", "z"]}}}
    e = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="float32", kv_pages=512,
                            max_model_len=256, max_num_seqs=64))
    assert e.runner.graphs, "decode CUDA graphs were not captured"
    e.start()
    try:
        grammar = e.grammar_compiler.compile(GrammarSpec("json", json.dumps(schema)))
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=grammar)
                  for i in range(48)]
        params += [SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True)
                   for i in range(16)]
        res = generate(e, [[5 + i, 6, 7] for i in range(64)], params)
    finally:
        e.shutdown(0)
    for r in res[:48]:
        assert r["finish_reason"] == "stop", r["text"]
        doc = json.loads(r["text"])
        assert set(doc) == {"a", "b"} and 0 <= doc["a"] <= 999 and doc["b"] in "xyz"
    assert all(len(r["token_ids"]) == 60 for r in res[48:])
