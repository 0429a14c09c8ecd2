"""The step thread's slow launches: a lone prompt with a cached prefix is prefilled by the
padded CUDA graph (a few launches, not ~1,000 eager ones that each let go of the GIL), and
a slow launch's log line says where its time went."""

from __future__ import annotations

import gc
import logging

from zerod.engine.metrics import SLOW_STEP_REASONS
import random
import threading
import time

import pytest
import torch

from zerod.engine.core import engine as engine_mod
from zerod.engine.demo import generate, make_checkpoint
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams
from zerod.engine.core.launch_clock import LaunchClock

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("stalls")
    make_checkpoint(d, "llama", seed=5)
    return d


def _prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(5, 380) for _ in range(n)]


def _engine(ckpt, pad: bool, calls: list) -> Engine:
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=300, max_model_len=128,
                            max_num_batched_tokens=32, max_num_seqs=4))
    e.runner.pad_prefill = pad   # on the CPU the padded path runs eager: the code a graph captures
    fwd = e.runner._prefill_padded_forward
    e.runner._prefill_padded_forward = lambda T, lora=False: (calls.append(T), fwd(T, lora))[1]
    return e


def test_cached_prefix_prompt_takes_the_padded_prefill_with_the_same_tokens(ckpt):
    head = _prompt(24, 1)
    # the whole prompt again (its last page is left to compute), a new tail after a cached
    # prefix, a tail that ends exactly on a page, and a longer one over two padded sizes
    prompts = [head, head, head[:16] + _prompt(9, 2), head[:20] + _prompt(4, 3), head + _prompt(20, 4)]
    out, hits = {}, {}
    for pad in (False, True):
        calls = []
        e = _engine(ckpt, pad, calls)
        e.start()
        try:
            out[pad] = [generate(e, [p], GREEDY)[0]["token_ids"] for p in prompts]
            hits[pad] = e.scheduler.cache.stats.hits
            deadline = time.monotonic() + 5   # the step thread releases the last one after its output
            while e.stats().running and time.monotonic() < deadline:
                time.sleep(0.005)
            assert e.stats().kv_pages_free == e.stats().kv_pages_total
        finally:
            e.shutdown(0)
        # chunks after the cache: 24 (whole), 4 (20 cached), 9 (16), 4 (20), 20 (24 cached)
        assert calls == ([32, 16, 16, 16, 32] if pad else [])
    assert hits[True] == hits[False] == 20 + 16 + 20 + 24
    assert out[True] == out[False]


def test_slow_launch_log_says_where_the_time_went(ckpt, monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "SLOW_LAUNCH_S", 0.0)   # every launch counts as slow
    monkeypatch.setattr(engine_mod, "SLOW_STEP_S", 0.0)
    e = _engine(ckpt, False, [])
    e.start()
    try:
        with caplog.at_level(logging.WARNING, logger="zerod.engine"):
            generate(e, [_prompt(10, 7)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finally:
        e.shutdown(0)
    lines = [r.getMessage() for r in caplog.records if "to launch" in r.getMessage()]
    assert len(lines) == 2   # the prefill step, then one decode step
    assert "(1 prompt chunks, 10 tokens, 0 decodes; staging" in lines[0]
    for part in ("step thread on CPU", "garbage collection", "waiting (GIL, device or a core)"):
        assert part in lines[0]
    assert "; 0 earlier steps unfinished; reason: " in lines[0]   # the first step: nothing ahead
    assert "earlier steps unfinished; reason: " in lines[1]
    # each counted under its reason in /metrics
    counted = {s.labels["reason"]: s.value for m in e.metrics.registry.collect()
               if m.name == "zerod_engine_slow_steps" for s in m.samples if s.name.endswith("_total")}
    assert sum(counted.values()) == 2 and set(counted) == set(SLOW_STEP_REASONS)


def test_launch_clock_splits_cpu_gc_and_waiting():
    clock = LaunchClock()
    junk = [[i] for i in range(200_000)]    # something for the collector to walk
    clock.start()
    time.sleep(0.05)                         # waiting: neither CPU nor collection
    clock.staged()
    gc.collect()
    took = clock.done()
    del junk
    assert took.wall >= 0.05 and took.stage >= 0.05
    assert took.gc > 0 and took.gc_elsewhere == 0   # this thread's collection is in its CPU time
    assert took.waited >= 0.04
    assert took.cpu < took.wall - 0.04


def test_a_collection_in_another_thread_counts_as_the_launch_s_gc_elsewhere():
    clock = LaunchClock()
    clock.start()
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()
    took = clock.done()
    assert took.gc_elsewhere == took.gc > 0


@pytest.mark.gpu
def test_a_burst_of_many_chunks_replays_prefill_graphs(tmp_path, monkeypatch):
    """48 short prompts at once: the steps of more than 32 chunks replay the prefill graph
    that holds them (Tuning.prefill_graph_chunk_tokens), none runs eager, and the tokens
    are those of the engine whose graphs hold 32 chunks (those steps eager)."""
    d = tmp_path / "f32"
    make_checkpoint(d, "llama", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    dtype="float32", seed=4)
    wave = [_prompt(8 + n % 5, n) for n in range(48)]
    out, steps = {}, {}
    for per in (8, 0):
        monkeypatch.setenv("ZEROD_TUNING", f'{{"prefill_graph_chunk_tokens": {per}}}')
        e = Engine(EngineConfig(model=str(d), device="cuda", dtype="float32", block_size=16, kv_pages=256,
                                max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=64))
        assert e.runner.pgraphs, "prefill CUDA graphs were not captured"
        padded, eager = [], []
        run, fwd = e.runner._prefill_padded, e.runner._prefill_padded_forward
        e.runner._prefill_padded = lambda p, *a: (padded.append((p.padded, len(p.seqlens))), run(p, *a))[1]
        e.runner._prefill_padded_forward = lambda T, lora=False: (eager.append(T), fwd(T, lora))[1]
        e.start()
        try:
            out[per] = [r["token_ids"] for r in generate(e, wave, GREEDY)]
        finally:
            e.shutdown(0)
        assert eager == [], eager   # every padded step had its graph
        steps[per] = max((c for _, c in padded), default=0)
    assert steps[8] > 32 >= steps[0], steps
    assert out[8] == out[0]


@pytest.mark.gpu
def test_cached_prefix_prefill_replays_its_graph_without_host_sync(tmp_path):
    d = tmp_path / "bf16"
    make_checkpoint(d, "llama", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    dtype="bfloat16", seed=3)
    e = Engine(EngineConfig(model=str(d), device="cuda", dtype="bfloat16", block_size=16, kv_pages=256,
                            max_model_len=256, max_num_seqs=8))
    assert e.runner.pgraphs, "prefill CUDA graphs were not captured"
    padded, eager = [], []
    run, fwd = e.runner._prefill_padded, e.runner._prefill_padded_forward
    e.runner._prefill_padded = lambda p, *a: (padded.append(p.padded), run(p, *a))[1]
    e.runner._prefill_padded_forward = lambda T, lora=False: (eager.append(T), fwd(T, lora))[1]   # no graph for T
    e.start()
    try:
        prompt = _prompt(40, 9)
        first = generate(e, [prompt], GREEDY)[0]["token_ids"]
        torch.cuda.set_sync_debug_mode("error")
        try:   # 32 of 40 tokens cached: an 8-token chunk, padded to 16
            again = generate(e, [prompt], GREEDY)[0]["token_ids"]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert padded == [64, 16] and eager == []
        assert again == first
    finally:
        e.shutdown(0)
