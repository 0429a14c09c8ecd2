"""The scheduler alone (no model): FIFO admission under the KV reservation, the chunk
budget, the waiting -> prefilling -> decoding moves and where pages go back."""

from __future__ import annotations

import torch

from zerod.engine.config import EngineConfig
from zerod.engine.spec.hf_config import parse_model_config
from zerod.engine.core.kv_pool import KVPool
from zerod.engine.core.request import Request, SamplingParams
from zerod.engine.core.scheduler import Batch, Chunk, Scheduler

MC = parse_model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 1,
                         "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 32})


def _sched(pages=11, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=4, **kw)
    return Scheduler(cfg, KVPool(MC, pages, 4, torch.float32, torch.device("cpu")))


def _req(i, prompt_len, max_tokens) -> Request:
    return Request(f"r{i}", [5 + i] * prompt_len, SamplingParams(max_tokens=max_tokens), lambda o: None,
                   max_tokens, seed=i)


def _submit(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        assert s.claim_wait_place()
        s.add(r)


def test_fifo_admission_stops_at_the_first_request_that_does_not_fit():
    s = _sched(pages=11)                     # 10 pages of 4 tokens
    big, mid, tiny = _req(0, 20, 12), _req(1, 8, 8), _req(2, 1, 1)   # 8, 4 and 1 pages
    _submit(s, big, mid, tiny)
    batch = s.schedule()
    assert s.prefilling == [big] and list(s.waiting) == [mid, tiny]   # tiny fits, but does not overtake
    assert len(big.pages) == 8 and s.pool.free == 2 and s.num_waiting == 2
    assert [(c.req, c.start, c.n) for c in batch.chunks] == [(big, 0, 20)]
    s.update(batch)
    s.remove(big)                            # done: its pages go back, the line moves
    s.schedule()
    assert s.prefilling == [mid, tiny] and not s.waiting and s.num_waiting == 0


def test_chunk_budget_is_small_while_streams_decode_and_whole_prompts_while_idle():
    s = _sched(pages=200, max_num_batched_tokens=8, max_prefill_tokens_idle=64)
    a = _req(0, 30, 4)
    _submit(s, a)
    batch = s.schedule()
    assert [(c.start, c.n, c.completes) for c in batch.chunks] == [(0, 30, True)]   # nothing decodes
    s.update(batch)
    assert s.decoding == [a] and a.num_scheduled == 1 and a.on_device
    b = _req(1, 20, 4)
    _submit(s, b)
    starts = []
    while b in s.prefilling or b in s.waiting:
        batch = s.schedule()
        assert batch.decodes == [a] or a.released
        starts += [(c.start, c.n) for c in batch.chunks]
        s.update(batch)
    assert starts == [(0, 8), (8, 8), (16, 4)]          # chunked by the budget while a decodes
    assert a.released and a.num_scheduled == 4          # max_tokens reached: pages back at once
    assert s.decoding == [b]


def test_wait_line_bound_and_removal_from_each_set():
    s = _sched(pages=11, max_waiting=2, max_num_seqs=1)
    r0, r1 = _req(0, 2, 2), _req(1, 2, 2)
    _submit(s, r0, r1)
    assert not s.claim_wait_place()          # full: the engine answers 429
    s.schedule()                             # one slot: r0 runs, r1 waits
    assert s.prefilling == [r0] and list(s.waiting) == [r1]
    s.remove(r1)
    s.remove(r0)
    assert s.num_waiting == 0 and not s.by_id and s.pool.free == s.pool.total and not s.has_work
    s.remove(r0)                             # twice is harmless
    assert s.pool.free == s.pool.total


def test_halves_split_the_rows_exactly_once():
    reqs = [_req(i, 4, 4) for i in range(7)]
    b = Batch([Chunk(r, 0, 4) for r in reqs[:3]], reqs[3:])
    seen = []

    def leaves(x: Batch):
        if len(x) == 1:
            seen.extend(x.requests())
        else:
            for h in x.halves():
                assert 0 < len(h) < len(x)
                leaves(h)
    leaves(b)
    assert seen == reqs


def test_chunk_budget_sees_the_whole_wait_line():
    """The step-cost budget gets the first prompts one by one and the rest of the line as
    one: a long line of short prompts asks for big chunks."""
    from zerod.engine.core.step_cost import DEADLINES_CHECKED

    s = _sched(pages=4000, max_num_batched_tokens=2048, max_num_seqs=256)
    for _ in range(5):                                # a measured 8B-like step
        s.cost.observe(0, 1, 0.006)
        for p in (200, 800, 1600):
            s.cost.observe(p, 1, 0.012 + 0.00002 * p)
    first = _req(0, 8, 4)
    _submit(s, first)
    s.update(s.schedule())                            # it decodes now
    reqs = [_req(i, 24, 4) for i in range(1, 201)]
    for r in reqs:
        assert s.claim_wait_place()
        s.add(r)
    assert s.waiting_tokens == 200 * 24
    seen = []
    s.cost.chunk_budget = lambda decodes, pending, **kw: seen.append(pending) or 2048
    s.schedule()
    pending = seen[0]
    assert len(pending) == DEADLINES_CHECKED + 1
    assert sum(p.tokens for p in pending) == 200 * 24     # admitted by now, nothing prefilled yet
    assert pending[-1].tokens == (200 - DEADLINES_CHECKED) * 24
