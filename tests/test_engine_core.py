"""The zero-layer loop on the CPU: pages, admission, rejection, aborts, sampling, stops."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time

import pytest
import torch

from zerod.engine.demo import generate, make_checkpoint
from zerod.engine.core.engine import Engine, EngineConfig, RequestRejected, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", seed=11)
    return d


@pytest.fixture(scope="module")
def eng(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=300, max_model_len=128,
                            max_num_batched_tokens=32, max_num_seqs=16))
    e.start()
    yield e
    e.shutdown(0)


def _prompt(n, seed=0, vocab=380):
    r = random.Random(seed)
    return [r.randrange(5, vocab) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_never_fits_is_400(eng):
    with pytest.raises(RequestRejected) as ei:
        eng.submit(_prompt(100), SamplingParams(max_tokens=29), lambda o: None)
    assert ei.value.status == 400 and "context" in ei.value.message
    with pytest.raises(RequestRejected) as ei:
        eng.submit([], SamplingParams(), lambda o: None)
    assert ei.value.status == 400
    with pytest.raises(RequestRejected) as ei:
        eng.submit([10**6], SamplingParams(), lambda o: None)
    assert ei.value.status == 400
    # max_tokens None = up to the context
    r = generate(eng, [_prompt(120)], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(r["token_ids"]) == 8 and r["finish_reason"] == "length"


def test_wait_line_full_is_429(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=50, max_waiting=2))  # not started: nothing leaves the line
    e.submit(_prompt(5), GREEDY, lambda o: None)
    e.submit(_prompt(5), GREEDY, lambda o: None)
    with pytest.raises(RequestRejected) as ei:
        e.submit(_prompt(5), GREEDY, lambda o: None)
    assert ei.value.status == 429 and ei.value.retry_after and ei.value.retry_after > 0
    assert e.stats().waiting == 2


def test_requests_larger_than_free_pages_wait_fifo(ckpt):
    # pool of 12 usable pages x 4 tokens = 48 tokens; each request needs 32 tokens (8 pages): one at a time
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=13, max_model_len=48))
    e.start()
    try:
        outs = generate(e, [_prompt(16, i) for i in range(4)],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 16 for o in outs)
        ends = [o["outputs"][-1] for o in outs]
        assert ends  # all finished
        assert e.stats().kv_pages_free == 12
    finally:
        e.shutdown(0)


def test_pages_all_free_after_random_aborts(eng):
    rnd = random.Random(5)
    n = 60
    finished = {}
    counts = {}
    lock = threading.Lock()
    done = threading.Event()
    ids = []

    def cb_for(i):
        def cb(o):
            with lock:
                counts[i] = counts.get(i, 0) + 1
                assert i not in finished, "output after finish"
                if o.finished:
                    finished[i] = o.finish_reason
                    if len(finished) == n:
                        done.set()
                elif rnd.random() < 0.05:
                    eng.abort(ids[i])          # abort from the poller thread (a client going away)
        return cb

    for i in range(n):
        sp = SamplingParams(max_tokens=rnd.randint(1, 40), temperature=rnd.choice([0.0, 0.8]),
                            ignore_eos=True)
        ids.append(None)
        ids[i] = eng.submit(_prompt(rnd.randint(1, 60), i), sp, cb_for(i))
        if rnd.random() < 0.2:
            eng.abort(ids[i])                  # abort right away (maybe still waiting)
        if rnd.random() < 0.1:
            time.sleep(0.01)
    for i in rnd.sample(range(n), 10):
        eng.abort(ids[i])
        eng.abort(ids[i])                      # idempotent
    assert done.wait(60), f"only {len(finished)} of {n} finished"
    assert set(finished.values()) <= {"length", "abort"}
    assert "abort" in finished.values() and "length" in finished.values()
    t = time.time() + 5
    while eng.stats().kv_pages_free != eng.stats().kv_pages_total and time.time() < t:
        time.sleep(0.01)
    st = eng.stats()
    assert st.kv_pages_free == st.kv_pages_total and st.running == 0 and st.waiting == 0
    eng.abort("req-does-not-exist")


def test_seed_reproducible_alone_and_batched(eng):
    p = _prompt(9, 1)
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a = generate(eng, [p], sp)[0]["token_ids"]
    b = generate(eng, [p], sp)[0]["token_ids"]
    others = [_prompt(k, 40 + k) for k in (3, 17, 30)]
    batch = generate(eng, others + [p] + others,
                     [SamplingParams(max_tokens=25, temperature=0.7, ignore_eos=True)] * 3 + [sp]
                     + [GREEDY] * 3)
    assert a == b == batch[3]["token_ids"]
    c = generate(eng, [p], SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert c["token_ids"] != a
    unseeded = generate(eng, [p, p], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    assert unseeded[0]["token_ids"] != unseeded[1]["token_ids"]


def test_top_k1_and_tiny_top_p_are_greedy(eng):
    p = _prompt(12, 2)
    g = generate(eng, [p], GREEDY)[0]["token_ids"]
    k1 = generate(eng, [p], SamplingParams(max_tokens=16, temperature=1.5, top_k=1, ignore_eos=True))[0]
    tp = generate(eng, [p], SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=3,
                                           ignore_eos=True))[0]
    assert k1["token_ids"] == g and tp["token_ids"] == g


def test_stop_token_ids_and_stop_strings(eng):
    p = _prompt(10, 3)
    full = generate(eng, [p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    ids, text = full["token_ids"], full["text"]
    # stop token id: ends at its first occurrence, token counted, its text not emitted
    k = 6
    r = generate(eng, [p], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ids[k]]))[0]
    first = ids.index(ids[k])
    assert r["finish_reason"] == "stop" and r["token_ids"] == ids[:first + 1]
    assert r["outputs"][-1].completion_tokens == first + 1
    # stop string: text ends right before it, never emitted (not even partly in earlier chunks)
    assert len(text) > 12
    stop = text[5:9]
    r = generate(eng, [p], SamplingParams(max_tokens=24, temperature=0, stop=[stop, "\x00never"]))[0]
    assert r["finish_reason"] == "stop"
    assert r["text"] == text[:text.index(stop)]
    assert stop not in r["text"]
    # stop string that never occurs: full text, length
    r = generate(eng, [p], SamplingParams(max_tokens=24, temperature=0, stop=["\x00\x01"]))[0]
    assert r["text"] == text and r["finish_reason"] == "length"


def test_eos_and_ignore_eos_and_min_tokens(ckpt, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(ckpt, d)
    e0 = Engine(EngineConfig(model=str(d), kv_pages=100))
    e0.start()
    p = _prompt(8, 4)
    ids = generate(e0, [p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]["token_ids"]
    e0.shutdown(0)
    eos = ids[5]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos]}))
    e = Engine(EngineConfig(model=str(d), kv_pages=100))
    assert eos in e.tokenizer.eos_token_ids
    e.start()
    try:
        r = generate(e, [p], SamplingParams(max_tokens=20, temperature=0))[0]
        assert r["finish_reason"] == "stop" and r["token_ids"] == ids[:ids.index(eos) + 1]
        r = generate(e, [p], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
        assert r["finish_reason"] == "length" and r["token_ids"] == ids
        # min_tokens: eos is masked while fewer than min_tokens were generated
        r = generate(e, [p], SamplingParams(max_tokens=20, temperature=0, min_tokens=12))[0]
        assert eos not in r["token_ids"][:12]
    finally:
        e.shutdown(0)


def test_metrics_registry(eng):
    from prometheus_client import generate_latest

    generate(eng, [_prompt(5)], GREEDY)
    text = generate_latest(eng.metrics.registry).decode()
    for name in ("zerod_engine_requests_running", "zerod_engine_requests_waiting",
                 "zerod_engine_kv_pages_total", "zerod_engine_kv_pages_free",
                 "zerod_engine_time_to_first_token_seconds_bucket",
                 "zerod_engine_inter_token_latency_seconds_bucket",
                 "zerod_engine_e2e_request_latency_seconds_bucket", "zerod_engine_prompt_tokens_total",
                 "zerod_engine_generation_tokens_total", 'zerod_engine_requests_total{finished_reason="length"}',
                 "zerod_engine_allocator_retries_total 0.0", "zerod_engine_allocator_ooms_total 0.0",
                 "zerod_engine_stream_errors_total 0.0", "zerod_engine_step_seconds_bucket"):
        assert name in text, name
    reg = eng.metrics.registry
    assert reg.get_sample_value("zerod_engine_kv_pages_total") == 299
    assert reg.get_sample_value("zerod_engine_generation_tokens_total") >= 16
    assert reg.get_sample_value("zerod_engine_requests_total", {"finished_reason": "length"}) >= 1


def test_streaming_outputs_are_incremental(eng):
    r = generate(eng, [_prompt(6, 8)], GREEDY)[0]
    outs = r["outputs"]
    assert len(outs) == 16
    assert [o.completion_tokens for o in outs] == list(range(1, 17))
    assert all(len(o.token_ids) == 1 for o in outs)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(o.prompt_tokens == 6 for o in outs)


def test_shutdown_aborts_running(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=200, max_model_len=512))
    e.start()
    got = []
    ev = threading.Event()

    def cb(o):
        if o.finished:
            got.append(o.finish_reason)
            ev.set()
    e.submit(_prompt(5), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), cb)
    time.sleep(0.05)
    e.shutdown(0)
    assert ev.wait(5) and got in (["abort"], ["length"])
    with pytest.raises(RequestRejected):
        e.submit(_prompt(5), GREEDY, lambda o: None)


def test_sampler_distribution_matches_softmax():
    from zerod.engine.sampling.sampler import sample

    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 1.5
    n = 4000
    rows = logits.expand(n, 8).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    tok = sample(rows, torch.full((n,), 1.0), torch.ones(n), torch.full((n,), -1, dtype=torch.int64),
                 seeds, torch.zeros(n, dtype=torch.int64), n_random=n, n_filter=0)
    freq = torch.bincount(tok, minlength=8).float() / n
    p = torch.softmax(logits[0], -1)
    assert (freq - p).abs().max() < 0.03, (freq, p)
    # top_k 2 only ever picks the two largest
    tok = sample(rows, torch.full((n,), 1.0), torch.ones(n), torch.full((n,), 2, dtype=torch.int64),
                 seeds, torch.zeros(n, dtype=torch.int64), n_random=n, n_filter=n)
    assert set(tok.tolist()) == set(logits[0].topk(2).indices.tolist())


def test_metrics_pass_promtool(eng):
    import shutil
    import subprocess

    from prometheus_client import generate_latest

    if not shutil.which("promtool"):
        pytest.skip("promtool not installed")
    generate(eng, [_prompt(4)], GREEDY)
    r = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(eng.metrics.registry),
                       capture_output=True, timeout=30)
    # promtool's lint reserves ':' for recording rules, and vLLM's own names (vllm:*, which
    # its dashboards read) have one; and vLLM names its tokens-per-step histogram
    # vllm:iteration_tokens_total: those are the only findings allowed
    findings = r.stderr.decode().splitlines() + r.stdout.decode().splitlines()
    bad = [ln for ln in findings if ln.strip() and not (
        ln.startswith("vllm:") and ln.endswith("metric names should not contain ':'")) and not (
        ln.startswith("vllm:iteration_tokens_total non-counter"))]
    assert not bad, bad


def test_many_one_token_prompts_with_tiny_budget(ckpt):
    """Staging buffers hold the worst case: every admission, one-token chunks, full decode."""
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=200, max_num_seqs=32, max_num_batched_tokens=8,
                            block_size=4, max_model_len=64))
    e.start()
    try:
        res = generate(e, [[5 + i] for i in range(32)] + [_prompt(20, 9)],
                       SamplingParams(max_tokens=6, temperature=0.5, top_k=3, ignore_eos=True))
        assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 6 for r in res)
        assert e.stats().kv_pages_free == e.stats().kv_pages_total
    finally:
        e.shutdown(0)


def test_padded_prefill_gives_the_same_tokens(ckpt):
    """The lone-prompt prefill that CUDA replays from a graph (a padded batch with a dummy
    sequence on the scratch page) gives exactly the tokens of the plain path; on the CPU
    it runs eager, the same code the graph captures."""
    prompts = [_prompt(n, seed=n) for n in (1, 2, 15, 16, 17, 31)]
    out = {}
    for pad in (False, True):
        e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=300, max_model_len=128,
                                max_num_batched_tokens=32, max_num_seqs=4))
        e.runner.pad_prefill = pad
        calls = []
        fwd = e.runner._prefill_padded_forward
        e.runner._prefill_padded_forward = lambda T, lora=False: (calls.append(T), fwd(T, lora))[1]
        e.start()
        try:
            # one at a time: the padded path is taken only for a prompt alone in its step
            out[pad] = [generate(e, [p], GREEDY)[0]["token_ids"] for p in prompts]
            assert e.stats().kv_pages_free == e.stats().kv_pages_total
            assert calls == ([16, 16, 16, 32, 32, 32] if pad else [])
        finally:
            e.shutdown(0)
    assert out[True] == out[False]
    assert all(len(t) == 16 for t in out[True])


def test_padded_prefill_takes_a_wave_of_prompts_beside_decodes(ckpt):
    """The prompts of a wave that arrives while another stream decodes are prefilled by
    padded forwards of several chunks each (the code a CUDA graph captures; on the CPU it
    runs eager) with exactly the tokens of the plain path, the decoding stream's included."""
    long = _prompt(6, seed=99)
    wave = [_prompt(n, seed=n) for n in (3, 5, 9, 12, 2, 7, 20, 4)]
    out = {}
    for pad in (False, True):
        e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=300, max_model_len=128,
                                max_num_batched_tokens=64, max_num_seqs=16))
        e.runner.pad_prefill = pad
        steps = []   # (padded tokens, chunks, decodes running) of each padded prefill
        run = e.runner._prefill_padded
        e.runner._prefill_padded = lambda p, *a: (steps.append((p.padded, len(p.seqlens), len(e.scheduler.decoding))),
                                                  run(p, *a))[1]
        e.start()
        try:
            first, got = threading.Event(), []

            def on_long(o):
                got.extend(o.token_ids)
                first.set()

            e.submit(long, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), on_long)
            assert first.wait(30)
            out[pad] = [r["token_ids"] for r in generate(e, wave, GREEDY)]
            deadline = time.monotonic() + 30
            while len(got) < 60 and time.monotonic() < deadline:
                time.sleep(0.01)
            out[pad].append(list(got))
        finally:
            e.shutdown(0)
        if pad:
            beside = [s for s in steps if s[2] > 0]
            assert beside and max(c for _, c, _ in beside) > 1, steps
        else:
            assert steps == []
    assert out[True] == out[False]
    assert all(len(t) == 16 for t in out[True][:-1]) and len(out[True][-1]) == 60


def test_padded_prefill_of_more_chunks_than_the_default_graph_holds(ckpt, monkeypatch):
    """A wave's step of more new prompts than 32 (Tuning.prefill_graph_seqs): with graphs of
    64 chunks it runs padded (the code a CUDA graph captures; eager on the CPU) with exactly
    the tokens of the plain path."""
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({"prefill_graph_seqs": 64}))
    wave = [_prompt(2 + n % 5, seed=n) for n in range(48)]
    out = {}
    for pad in (False, True):
        out[pad], chunks = _wave(ckpt, wave, pad, kv_pages=600, max_model_len=256, budget=256)
        assert (max(chunks) > 32) if pad else chunks == [], chunks
    assert out[True] == out[False]
    assert all(len(t) == 16 for t in out[True])


def _wave(ckpt, wave: list, pad: bool, kv_pages: int, max_model_len: int, budget: int,
          check=None) -> tuple[list, list[int]]:
    """A wave's tokens through a fresh engine, with the padded prefill (the code a CUDA
    graph captures; eager on the CPU) or without, and the chunk count of each padded step.
    check(engine) runs before it starts."""
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=kv_pages, max_model_len=max_model_len,
                            max_num_batched_tokens=budget, max_prefill_tokens_idle=budget, max_num_seqs=64))
    e.runner.pad_prefill = pad
    if check is not None:
        check(e)
    chunks = []
    run = e.runner._prefill_padded
    e.runner._prefill_padded = lambda p, *a: (chunks.append(len(p.seqlens)), run(p, *a))[1]
    e.start()
    try:
        return [r["token_ids"] for r in generate(e, wave, GREEDY)], chunks
    finally:
        e.shutdown(0)


def test_a_larger_prefill_graph_holds_more_chunks(ckpt, monkeypatch):
    """A graph of T tokens holds max(32, T // 8) chunks (Tuning.prefill_graph_chunk_tokens):
    a burst's step of 48 short prompts runs padded (the code a CUDA graph captures; eager on
    the CPU) in the smallest graph that holds both its tokens and its chunks, with exactly
    the tokens of the plain path; at 0 every graph holds 32 and that step runs eager."""
    from types import SimpleNamespace

    from zerod.engine.runner.graphs import prefill_graph_seqs
    from zerod.engine.tuning import Tuning

    assert [prefill_graph_seqs(Tuning(), t, 256) for t in (16, 256, 384, 1024, 2048, 2320)] == [32, 32, 48, 128, 256, 256]
    assert prefill_graph_seqs(Tuning(prefill_graph_chunk_tokens=0), 2048, 256) == 32
    assert prefill_graph_seqs(Tuning(), 2048, 64) == 64 and prefill_graph_seqs(Tuning(), 16, 8) == 8
    wave = [_prompt(8 + n % 5, seed=n) for n in range(48)]
    out = {}
    def buckets(e):   # 40 chunks of 2 tokens: not the 128-token graph (32 chunks), the 384's (48)
        assert e.runner._prefill_bucket([SimpleNamespace(n=2)] * 40) == 384
        assert e.runner._prefill_bucket([SimpleNamespace(n=2)] * 20) == 64

    for per in (8, 0, None):   # None: the plain path
        monkeypatch.setenv("ZEROD_TUNING", json.dumps({"prefill_graph_chunk_tokens": per or 0}))
        out[per], chunks = _wave(ckpt, wave, per is not None, kv_pages=800, max_model_len=1024, budget=1024,
                                 check=buckets if per == 8 else None)
        if per == 8:
            assert max(chunks) > 32, chunks
        else:
            assert all(c <= 32 for c in chunks), chunks
    assert out[8] == out[None] and out[0] == out[None]


def test_long_prompt_goes_in_whole_only_while_nothing_decodes(ckpt):
    """Chunked prefill exists so a long prompt cannot stall running streams; with nothing
    decoding there is nothing to stall, and the prompt goes in one step."""
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=300, max_model_len=128,
                            max_num_batched_tokens=8, max_prefill_tokens_idle=64, max_num_seqs=4))
    e.start()
    try:
        lone = generate(e, [_prompt(60, 1)], SamplingParams(max_tokens=1, temperature=0))[0]
        assert lone["finish_reason"] == "length"
        assert e.stats().steps == 1          # 60 prompt tokens in one step, not 8 chunks of 8
        # a long prompt arriving while another request decodes is chunked by 8 tokens
        first, done = threading.Event(), threading.Event()
        outs = []

        def on_short(o):
            first.set()
            if o.finished:
                done.set()

        e.submit(_prompt(4, 2), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), on_short)
        assert first.wait(10)
        steps0 = e.stats().steps
        long = generate(e, [_prompt(60, 3)], SamplingParams(max_tokens=1, temperature=0))[0]
        assert long["finish_reason"] == "length"
        assert e.stats().steps - steps0 >= 60 // 8   # prefilled in chunks of <= 8 tokens
        assert done.wait(30)
    finally:
        e.shutdown(0)


def test_staged_fields_are_16_byte_aligned():
    """Triton specialises kernels on 16-byte pointer alignment: every staged field starts
    on a 16-byte boundary, whatever the sizes before it."""
    from zerod.engine.runner.staging import Staging

    st = Staging(256, 1, torch.device("cpu"), pin=False)
    pk = st.packer(0)
    views = [pk.int32([1, 2, 3]), pk.int64([4]), pk.float32([0.5] * 5), pk.int32([7]), pk.int64([8, 9])]
    pk.ship()
    assert all(v.data_ptr() % 16 == 0 for v in views)
    assert [v.tolist() for v in views] == [[1, 2, 3], [4], [0.5] * 5, [7], [8, 9]]
