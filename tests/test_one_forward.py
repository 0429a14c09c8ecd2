"""One forward a step (`Tuning.one_forward_mixed_steps`): a step with prompt chunks and
decodes runs them in one forward, the decodes its last rows, their attention through the
decode kernel. A request's tokens and logprobs are those of the two-forward engine,
whatever it shared a step with: greedy, seeded sampling, penalties, a logit_bias,
logprobs, chunked prompts, a sliding window."""

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


def _serve(ckpt, monkeypatch, one_forward: bool, padded: bool | None, **cfg):
    """Three long requests decode; once each has two tokens, four more arrive (prompts of
    5-70 tokens, chunked at 32): steps that mix chunks and decodes. Every output, and how
    many steps ran as one forward. padded: the prefill graphs' padded layout, run eagerly
    (the CPU captures no graph); None: as the engine built it (a GPU captures the graphs)."""
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({"one_forward_mixed_steps": one_forward}))
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=256, max_num_seqs=16, max_num_batched_tokens=32,
                            min_prefill_chunk=32, max_prefill_tokens_idle=32, seed=0, **cfg))
    fused = [0]
    hidden = e.runner.prefill_hidden

    def counting(p, ring_idx=-1, decode_slots=None):
        fused[0] += decode_slots is not None
        return hidden(p, ring_idx, decode_slots)

    e.runner.prefill_hidden = counting
    if padded is not None:
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
    from zerod.engine.model import decoder

    plain, none = _serve(ckpt, monkeypatch, one_forward=False, padded=padded)
    seen = []
    attention = decoder.LlamaModel._attention

    def spy(self, L, x, positions, kv, meta):
        if meta.decode_tail:
            live = int((meta.decode_context_lens > 0).sum())
            seen.append((positions.shape[0], meta.decode_tail, live, int(meta.cu_seqlens_q[-1])))
        return attention(self, L, x, positions, kv, meta)

    monkeypatch.setattr(decoder.LlamaModel, "_attention", spy)
    fused, n = _serve(ckpt, monkeypatch, one_forward=True, padded=padded)
    # the decodes' rows close the forward, outside every prefill sequence, and the decode
    # kernel reads them
    mixed = [x for x in seen if x[2]]
    assert mixed and all(last <= T - live for T, _, live, last in mixed)
    if padded:   # a graph's tail is fixed: min(max_num_seqs, T) rows, the decodes the last
        assert all(tail == min(16, T) for T, tail, _, _ in seen)
    assert none == 0 and n > 0, n            # the second run had mixed steps, as one forward
    assert fused == plain
    assert all(len(ids) == (24 if i < len(LONG) else 8) for i, (ids, _) in plain.items())


def test_the_decodes_lm_head_runs_at_the_decode_graphs_row_counts(ckpt, monkeypatch):
    """The LM head of a one-forward step's decodes runs over a decode graph's row count
    (the rows before the decodes' dropped), so it launches only GEMMs the graphs' warm-up
    ran: the answers stay the two-forward engine's."""
    from zerod.engine.model import decoder

    plain, _ = _serve(ckpt, monkeypatch, one_forward=False, padded=True)
    rows_seen, fused_step = [], [False]
    logits = decoder.LlamaModel.logits

    def spy(self, hidden):
        if fused_step[0]:
            rows_seen.append(hidden.shape[0])
        return logits(self, hidden)

    monkeypatch.setattr(decoder.LlamaModel, "logits", spy)
    build = Engine.__init__

    def with_buckets(self, *a, **k):   # the CPU captures no graph: the sizes a GPU's would have
        build(self, *a, **k)
        self.runner.buckets = [1, 2, 4, 64]   # 5-7 decodes: a size past the smaller forwards
        launch = self.runner.launch

        def marking(ring_idx, x):   # the LM heads of one-forward steps only
            fused_step[0] = x.prefill is not None and x.prefill.decode_rows is not None
            try:
                return launch(ring_idx, x)
            finally:
                fused_step[0] = False

        self.runner.launch = marking

    monkeypatch.setattr(Engine, "__init__", with_buckets)
    fused, n = _serve(ckpt, monkeypatch, one_forward=True, padded=True)
    assert n > 0 and fused == plain
    # chunk rows sample 1-4 at a time (32-token budget); up to 7 decodes share a step, in
    # forwards of 16-64 rows
    assert set(rows_seen) <= {1, 2, 3, 4, 64} and 64 in rows_seen, sorted(set(rows_seen))


@pytest.mark.gpu
def test_one_forward_through_the_captured_graphs_on_a_gpu(ckpt, monkeypatch):
    """The same on a GPU, bf16: the mixed steps replay the captured prefill graphs with
    the decodes as their last rows. The decode rows' products share the chunks' GEMMs
    (another row count, so another cuBLAS kernel and summing order), and bf16 rounds the
    two differently, so a greedy token may flip where two candidates tie to bf16's
    precision and the stream goes its own way after it: the first token of every request
    must agree, and nearly all of the rest (the exact proof is the float32 test above)."""
    plain, _ = _serve(ckpt, monkeypatch, one_forward=False, padded=None, device="cuda", dtype="bfloat16")
    fused, n = _serve(ckpt, monkeypatch, one_forward=True, padded=None, device="cuda", dtype="bfloat16")
    assert n > 0
    assert sorted(fused) == sorted(plain) == list(range(len(LONG) + len(LATE)))
    assert all(len(fused[i][0]) == len(plain[i][0]) for i in plain)
    assert [fused[i][0][0] for i in sorted(plain)] == [plain[i][0][0] for i in sorted(plain)]
    same = sum(a == b for i in plain for a, b in zip(fused[i][0], plain[i][0]))
    assert same >= 0.9 * sum(len(ids) for ids, _ in plain.values()), same


def test_a_full_budget_beside_every_decode_has_a_graph(ckpt, monkeypatch):
    """One forward a step adds the prefill graph a full prompt budget needs beside
    --max-num-seqs decodes; without it the sizes stop at the budget plus a page."""
    from zerod.engine.core.scheduler import Chunk

    sizes = {}
    for on in (False, True):
        monkeypatch.setenv("ZEROD_TUNING", json.dumps({"one_forward_mixed_steps": on}))
        e = Engine(EngineConfig(model=str(ckpt), kv_pages=64, max_num_seqs=16, max_num_batched_tokens=32,
                                max_model_len=128))
        try:
            sizes[on] = list(e.runner.pgraph_sizes)
            e.runner.pad_prefill = True
            full = [Chunk(type("R", (), {})(), 0, 32)]
            bucket = e.runner._prefill_bucket(full, decodes=16)
        finally:
            e.shutdown(0)
    assert max(sizes[False]) == 32 + 16 and max(sizes[True]) == 32 + 16 + 16
    assert bucket == 64
