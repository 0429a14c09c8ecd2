"""One forward a step (`Tuning.one_forward_mixed_steps`): a step with prompt chunks and
decodes runs them in one forward, each decode a one-token sequence after the chunks. A
request's tokens and logprobs are those of the two-forward engine, whatever it shared a
step with: greedy, seeded sampling, penalties, a logit_bias, logprobs, chunked prompts, a
sliding window."""

from __future__ import annotations

import json
import threading

import pytest

from zerod.engine.config import EngineConfig
from zerod.engine.core.engine import Engine
from zerod.engine.core.request import SamplingParams
from zerod.engine.demo import make_checkpoint

LONG = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                       ignore_eos=True, logprobs=2)]
LATE = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True, logit_bias={5: 4.0}),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=8, temperature=0, frequency_penalty=0.7, ignore_eos=True)]


@pytest.fixture(scope="module", params=["llama", "mistral"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(d, request.param, seed=11)
    if request.param == "mistral":   # every layer within a 24-token window: a ring of pages
        cfg = json.loads((d / "config.json").read_text())
        cfg["sliding_window"] = 24
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _serve(ckpt, monkeypatch, one_forward: bool, padded: bool):
    """Three long requests decode; once each has two tokens, four more arrive (prompts of
    5-70 tokens, chunked at 32): steps that mix chunks and decodes. Every output, and how
    many steps ran as one forward. padded: the prefill graphs' padded layout, run eagerly
    (the CPU captures no graph)."""
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({"one_forward_mixed_steps": one_forward}))
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=256, max_num_seqs=16, max_num_batched_tokens=32,
                            min_prefill_chunk=32, max_prefill_tokens_idle=32, seed=0))
    fused = [0]
    hidden = e.runner.prefill_hidden

    def counting(p, ring_idx=-1, decode_slots=None):
        fused[0] += decode_slots is not None
        return hidden(p, ring_idx, decode_slots)

    e.runner.prefill_hidden = counting
    e.runner.pad_prefill = padded
    e.start()
    outs: dict[int, list] = {}
    done = threading.Semaphore(0)
    started = threading.Semaphore(0)

    def collect(i):
        def cb(o):
            outs.setdefault(i, []).append(o)
            if len(outs[i]) == 2 and i < len(LONG):
                started.release()
            if o.finished:
                done.release()
        return cb

    try:
        for i, p in enumerate(LONG):
            e.submit([10 + i, 20, 30, 40, 50, 60][: 4 + i], p, collect(i))
        for _ in LONG:
            assert started.acquire(timeout=60)
        for j, p in enumerate(LATE):
            n = (5, 70, 33, 12)[j]
            e.submit([(7 * k + j) % 200 + 3 for k in range(n)], p, collect(len(LONG) + j))
        for _ in range(len(LONG) + len(LATE)):
            assert done.acquire(timeout=60)
    finally:
        e.shutdown(0)
    result = {}
    for i, os_ in outs.items():
        ids = [t for o in os_ for t in o.token_ids]
        lps = [lp for o in os_ for lp in (o.logprobs or [])]
        result[i] = (ids, [(lp.token_id, round(lp.logprob, 3)) for lp in lps] if lps else None)
    return result, fused[0]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-layout"])
def test_one_forward_gives_every_request_the_two_forward_answer(ckpt, monkeypatch, padded):
    plain, none = _serve(ckpt, monkeypatch, one_forward=False, padded=padded)
    fused, n = _serve(ckpt, monkeypatch, one_forward=True, padded=padded)
    assert none == 0 and n > 0, n            # the second run had mixed steps, as one forward
    assert fused == plain
    assert all(len(ids) == (24 if i < len(LONG) else 8) for i, (ids, _) in plain.items())
