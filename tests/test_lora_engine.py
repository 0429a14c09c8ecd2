"""Multi-LoRA in the engine: greedy output per adapter token-exact with PEFT's merged
model (fp32, CPU); a batch mixing the base and several adapters equals each alone; the
device LRU (more adapters than --max-loras) and host LRU (more than --max-cpu-loras)
reload adapters without changing a token; the prefix cache keeps adapters apart."""

from __future__ import annotations

import time

import pytest
import torch

from families_support import hf_greedy, prompts
from lora_support import ADAPTERS, base_and_adapters, generate
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams

NEW = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base, paths, models = base_and_adapters(tmp_path_factory.mktemp("lora"))
    ps = prompts(300)[:6]
    want = {name: hf_greedy(m, ps, NEW) for name, m in models.items()}
    for name in ADAPTERS:
        assert want[name] != want[None], f"adapter {name} does not change the output: a vacuous test"
    return base, paths, ps, want


def engine(base, paths, **kw) -> Engine:
    cfg = dict(model=str(base), block_size=4, kv_pages=400, max_num_batched_tokens=16,
               max_prefill_tokens_idle=16, enable_lora=True, max_lora_rank=16,
               lora_modules=tuple((n, str(p), None) for n, p in paths.items()))
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    eng.start()
    return eng


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def test_each_adapter_alone_equals_peft(setup):
    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=3)
    try:
        for name in [None, *ADAPTERS]:
            got = generate(eng, [(p, name) for p in ps], GREEDY)
            assert [g["token_ids"] for g in got] == want[name], f"adapter {name} differs from PEFT"
    finally:
        eng.shutdown(0)


def _every_pair_equals_peft(eng, ps, want, where: str) -> None:
    """Every prompt under every adapter and the base, all in one wave: PEFT's tokens."""
    jobs = [(p, n) for p in ps for n in [None, *ADAPTERS]]
    for (p, n), g in zip(jobs, generate(eng, jobs, GREEDY)):
        assert g["token_ids"] == want[n][ps.index(p)], f"adapter {n} {where}"


def test_mixed_batch_equals_each_alone(setup):
    """Every prompt under every adapter and the base, all in one wave: rows of four kinds
    share prefill chunks and decode steps."""
    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=3)
    try:
        _every_pair_equals_peft(eng, ps, want, "in a mixed batch")
        assert eng.stats().kv_pages_free == eng.stats().kv_pages_total
    finally:
        eng.shutdown(0)


def test_mixed_batch_through_the_padded_prefill_equals_peft(setup):
    """The prompt chunks of adapters and the base through the padded prefill forward that
    a CUDA graph captures (with the LoRA path in it: on the CPU it runs eager): PEFT's
    tokens, and several adapters' chunks share one padded forward."""
    base, paths, ps, want = setup
    eng = Engine(EngineConfig(model=str(base), block_size=4, kv_pages=400, max_num_batched_tokens=128,
                              max_prefill_tokens_idle=128, enable_lora=True, max_lora_rank=16, max_loras=3,
                              lora_modules=tuple((n, str(p), None) for n, p in paths.items())))
    eng.runner.pad_prefill = True
    seen = []   # the adapter slots of each padded forward's real rows
    run = eng.runner._prefill_padded
    eng.runner._prefill_padded = lambda p, *a: (seen.append(None if p.lora_rows is None else
                                                            set(p.lora_rows[:p.n_real].tolist())), run(p, *a))[1]
    eng.start()
    try:
        _every_pair_equals_peft(eng, ps, want, "through the padded prefill")
    finally:
        eng.shutdown(0)
    assert any(s is not None and len(s - {0}) > 1 for s in seen), seen


def test_mixed_steps_as_one_forward_equal_peft(setup, monkeypatch):
    """One forward a step (Tuning.one_forward_mixed_steps): decodes of adapters and the
    base share a forward with other requests' prompt chunks, each decode row with its own
    adapter, eager and in the padded layout: PEFT's tokens."""
    import json

    base, paths, ps, want = setup
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({"one_forward_mixed_steps": True}))
    for padded in (False, True):
        eng = Engine(EngineConfig(model=str(base), block_size=4, kv_pages=400, max_num_batched_tokens=16,
                                  max_prefill_tokens_idle=16, enable_lora=True, max_lora_rank=16, max_loras=3,
                                  lora_modules=tuple((n, str(p), None) for n, p in paths.items())))
        eng.runner.pad_prefill = padded
        fused = []   # the adapter slots of each one-forward step's decode rows
        hidden = eng.runner.prefill_hidden

        def counting(p, ring_idx=-1, decode_slots=None, hidden=hidden, fused=fused):
            if decode_slots is not None:
                fused.append(set(p.lora_rows.index_select(0, p.decode_rows).tolist()) if p.lora_rows is not None
                             else {0})
            return hidden(p, ring_idx, decode_slots)

        eng.runner.prefill_hidden = counting
        eng.start()
        try:
            _every_pair_equals_peft(eng, ps, want, f"as one forward ({'padded' if padded else 'eager'})")
        finally:
            eng.shutdown(0)
        assert any(len(s - {0}) > 1 for s in fused), fused   # several adapters' decodes in one


def test_fewer_slots_than_adapters_reloads_exactly(setup):
    """--max-loras 1 and --max-cpu-loras 1: three adapters take turns in one device slot
    and their host copies are read again from disk; every token stays PEFT's."""
    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=1, max_cpu_loras=1)
    try:
        for _ in range(2):
            jobs = [(p, n) for n in ADAPTERS for p in ps[:3]]
            got = generate(eng, jobs, GREEDY)
            for (p, n), g in zip(jobs, got):
                assert g["token_ids"] == want[n][ps.index(p)]
    finally:
        eng.shutdown(0)


def test_prefix_cache_is_per_adapter(setup):
    """The same long prompt under two adapters: the second cannot reuse the first's KV
    (it would be the other adapter's); the same adapter again does."""
    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=3)
    try:
        p = ps[-1]
        assert len(p) >= 12
        hits = []
        for n in ("all8", "qv4", "all8"):
            before = eng.scheduler.cache.stats.hits
            got = generate(eng, [(p, n)], GREEDY)
            assert got[0]["token_ids"] == want[n][len(ps) - 1]
            hits.append(eng.scheduler.cache.stats.hits - before)
        assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0
    finally:
        eng.shutdown(0)


def test_unknown_adapter_is_refused_and_counted_adapters_in_metrics(setup):
    from prometheus_client import generate_latest

    from zerod.engine.config import RequestRejected

    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=2)
    try:
        with pytest.raises(RequestRejected) as e:
            eng.submit(ps[0], GREEDY, lambda o: None, lora="nope")
        assert e.value.status == 404 and "nope" in e.value.message
        generate(eng, [(ps[0], "qv4"), (ps[1], "qv4"), (ps[2], None)], GREEDY)
        text = generate_latest(eng.metrics.registry).decode()
        assert 'zerod_engine_lora_requests_total{lora_name="qv4"} 2.0' in text
        # vLLM's gauge, as LoRA-aware gateways read it: qv4 ran; once the step loop has seen
        # the requests end (a step later at most), nothing runs or waits
        want = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
        deadline = time.monotonic() + 5
        while want not in text and time.monotonic() < deadline:
            time.sleep(0.05)
            text = generate_latest(eng.metrics.registry).decode()
        assert want in text
    finally:
        eng.shutdown(0)


def test_unload_lets_submitted_requests_finish(setup):
    base, paths, ps, want = setup
    eng = engine(base, paths, max_loras=1)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        import threading

        done = threading.Event()
        out = []

        def cb(o):
            out.extend(o.token_ids)
            if o.finished:
                out.append(o.finish_reason)
                done.set()

        eng.submit(ps[0], params, cb, lora="all8")
        eng.unload_lora("all8")
        from zerod.engine.config import RequestRejected

        with pytest.raises(RequestRejected):
            eng.submit(ps[0], GREEDY, lambda o: None, lora="all8")
        assert done.wait(60) and out[-1] == "length" and len(out) == 41
        assert out[:NEW] == want["all8"][0]
        eng.load_lora("all8", str(paths["all8"]))   # back under the same name
        assert generate(eng, [(ps[1], "all8")], GREEDY)[0]["token_ids"] == want["all8"][1]
    finally:
        eng.shutdown(0)


def test_reference_matches_a_plain_delta():
    """The torch reference over slabs: slot 0 adds exactly nothing, a fused projection's
    segments each read their own rank block."""
    from zerod.engine.lora.delta import lora_reference

    g = torch.Generator().manual_seed(0)
    R, n_in, segs = 4, 8, (6, 3, 3)
    A = torch.randn(3, 3 * R, n_in, generator=g)
    B = torch.randn(3, sum(segs), R, generator=g)
    A[0].zero_()
    B[0].zero_()
    x = torch.randn(5, n_in, generator=g)
    y = torch.randn(5, sum(segs), generator=g)
    idx = torch.tensor([0, 1, 2, 1, 0], dtype=torch.int32)
    got = lora_reference(y.clone(), x, A, B, segs, idx)
    for t, s in enumerate(idx.tolist()):
        want = y[t].clone()
        n0 = 0
        for j, n in enumerate(segs):
            want[n0:n0 + n] += B[s, n0:n0 + n] @ (A[s, j * R:(j + 1) * R] @ x[t])
            n0 += n
        torch.testing.assert_close(got[t], want)
    assert torch.equal(got[0], y[0]) and torch.equal(got[4], y[4])


def test_adapter_on_a_model_with_qkv_bias_equals_peft(tmp_path):
    """Qwen2 (biases on q/k/v): the projection's bias widens with the weight that carries
    the A rows, and its base output and each adapter's are still PEFT's."""
    from families_support import hf_checkpoint, hf_model
    from lora_support import LLAMA, make_adapter

    base = hf_checkpoint(tmp_path / "base", "Qwen2Config", "Qwen2ForCausalLM", seed=5, **LLAMA)
    cfg = ADAPTERS["all8"]
    merged = make_adapter(base, tmp_path / "a", 3, **cfg)
    ps = prompts(300)[:4]
    want = {None: hf_greedy(hf_model(base), ps, NEW), "a": hf_greedy(merged, ps, NEW)}
    assert want["a"] != want[None]
    eng = engine(base, {"a": tmp_path / "a"}, max_loras=1)
    try:
        L = eng.runner.model.layers[0].qkv
        assert L.lora.bias is not None and L.bias.data_ptr() == L.lora.bias.data_ptr()
        got = generate(eng, [(p, n) for n in want for p in ps], GREEDY)
        assert [g["token_ids"] for g in got] == want[None] + want["a"]
    finally:
        eng.shutdown(0)


def test_adapters_on_fp8_weights_shrink_on_their_own(setup):
    """--quantization fp8: the quantized projections keep A in slabs of their own (their
    weight cannot carry it). Each adapter changes the output, and a batch mixing the base
    and every adapter gives each row what it gets alone."""
    base, paths, ps, _ = setup
    eng = engine(base, paths, max_loras=3, quantization="fp8")
    try:
        assert eng.runner.model.layers[0].qkv.lora.weight is None
        names = [None, *ADAPTERS]
        alone = {n: [g["token_ids"] for g in generate(eng, [(p, n) for p in ps], GREEDY)] for n in names}
        for n in ADAPTERS:
            assert alone[n] != alone[None], f"adapter {n} changes nothing on FP8 weights"
        jobs = [(p, n) for p in ps for n in names]
        for (p, n), g in zip(jobs, generate(eng, jobs, GREEDY)):
            assert g["token_ids"] == alone[n][ps.index(p)], f"adapter {n} in a mixed batch"
    finally:
        eng.shutdown(0)


def test_registered_adapters_are_resident_before_ready(setup, monkeypatch):
    """The --lora-modules adapters (up to --max-loras) are written to their device slots at
    start: a first request writes none on the step thread, and answers as PEFT does."""
    import zerod.engine.lora.manager as manager

    base, paths, ps, want = setup
    writes: list[int] = []
    real = manager.write_slot
    monkeypatch.setattr(manager, "write_slot", lambda model, slot, a: (writes.append(slot), real(model, slot, a)))
    eng = engine(base, paths, max_loras=len(ADAPTERS))
    try:
        assert sorted(writes) == list(range(1, len(ADAPTERS) + 1))   # one slot each, at start
        writes.clear()
        for name in ADAPTERS:
            got = generate(eng, [(ps[0], name)], GREEDY)
            assert got[0]["token_ids"] == want[name][0]
        assert writes == []
    finally:
        eng.shutdown(0)
