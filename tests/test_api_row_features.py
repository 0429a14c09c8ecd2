"""Per-feature counts of the scheduler's requests (engine/core/row_features.py): a step looks for
a feature's rows only while some request uses it, and its outputs are the same either way."""

from __future__ import annotations

import torch

from zerod.engine.config import EngineConfig
from zerod.engine.spec.hf_config import parse_model_config
from zerod.engine.core.kv_pool import KVPool
from zerod.engine.core.request import Request, SamplingParams
from zerod.engine.core.row_features import ALL, FeatureCounts
from zerod.engine.sampling.sampler import row_class
from zerod.engine.core.scheduler import Batch, Scheduler


def _req(i: int, **kw) -> Request:
    p = SamplingParams(max_tokens=4, **kw)
    return Request(f"r{i}", [5, 6], p, lambda o: None, 4, i,
                   sample_class=row_class(p.temperature, p.top_k, p.top_p, p.min_p))


def test_counts_follow_admission_and_the_end():
    mc = parse_model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                             "num_attention_heads": 1, "num_hidden_layers": 1,
                             "intermediate_size": 8, "vocab_size": 32})
    s = Scheduler(EngineConfig(block_size=4), KVPool(mc, 64, 4, torch.float32, torch.device("cpu")))
    plain = [_req(i, temperature=0.0) for i in range(3)]
    for r in plain:
        s.claim_wait_place()
        s.add(r)
    u = s.schedule().uses
    assert not (u.penalty or u.bias or u.logprobs or u.prompt_logprobs or u.grammar
                or u.min_p or u.min_tokens)
    assert u.one_class == 2                        # all greedy: no sort by class
    fancy = _req(9, presence_penalty=0.5, logit_bias={3: 1.0}, logprobs=2, min_p=0.1,
                 min_tokens=1, prompt_logprobs=0)
    s.claim_wait_place()
    s.add(fancy)
    u = s.schedule().uses
    assert u.penalty and u.bias and u.logprobs and u.prompt_logprobs and u.min_p and u.min_tokens
    assert not u.grammar and u.one_class is None
    s.remove(fancy)
    assert s.schedule().uses == s.features.uses() and not s.features.uses().penalty
    for r in plain:
        s.remove(r)
    assert s.features.counts == FeatureCounts().counts and s.features.classes == [0, 0, 0]


def test_a_hand_made_batch_looks_for_every_feature():
    assert Batch().uses == ALL and Batch().masked


def test_outputs_equal_with_and_without_the_counts(tmp_path):
    """Every feature in one batch: the engine's outputs equal those of steps that scan every
    row (Batch's default), so skipping a scan never changes what is sampled."""
    from zerod.engine.demo import generate
    from zerod.engine.core.engine import Engine, EngineConfig as EC
    import zerod.engine.core.scheduler as sched_mod

    def outputs() -> list[list[int]]:
        eng = Engine(EC(model="demo", device="cpu", max_model_len=128, kv_pages=256, seed=0))
        eng.start()
        try:
            ps = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
            res = generate(eng, ps, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            res += generate(eng, ps[:1], SamplingParams(max_tokens=6, temperature=0.8, seed=3,
                                                        presence_penalty=1.0, min_p=0.05,
                                                        min_tokens=2, ignore_eos=True))
            return [r["token_ids"] for r in res]
        finally:
            eng.shutdown(0)

    counted = outputs()
    real = sched_mod.FeatureCounts.uses
    sched_mod.FeatureCounts.uses = lambda self: ALL
    try:
        scanned = outputs()
    finally:
        sched_mod.FeatureCounts.uses = real
    assert counted == scanned
