"""Prefix caching end to end on the CPU: the same tokens with and without the cache, for
shared, partial-page and unshared prefixes, greedy and seeded sampling, requests that share
pages still being written, and eviction under pressure; cached_tokens reported."""

from __future__ import annotations

import random

import pytest

from zerod.engine.demo import generate, make_checkpoint
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams

PS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-pc")
    make_checkpoint(d, "llama", seed=5)
    return d


def _engine(ckpt, cache: bool, **kw) -> Engine:
    cfg = dict(model=str(ckpt), block_size=PS, kv_pages=400, max_model_len=160,
               max_num_batched_tokens=16, max_num_seqs=16, enable_prefix_caching=cache)
    cfg.update(kw)
    e = Engine(EngineConfig(**cfg))
    e.start()
    return e


@pytest.fixture(scope="module")
def plain(ckpt):
    e = _engine(ckpt, False)
    yield e
    e.shutdown(0)


@pytest.fixture
def cached(ckpt):
    e = _engine(ckpt, True)
    yield e
    e.shutdown(0)


def _toks(n, seed):
    r = random.Random(seed)
    return [r.randrange(5, 380) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _seeded(i):
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)


def _ids(outs):
    return [o["token_ids"] for o in outs]


def _cached_tokens(out) -> int:
    return out["outputs"][-1].cached_tokens


def test_shared_prefix_same_tokens_and_cached_tokens_reported(plain, cached):
    system = _toks(37, 1)                          # 9 full pages + 1 token
    prompts = [system + _toks(5 + i, 100 + i) for i in range(6)]
    want = _ids(generate(plain, prompts, GREEDY))
    first = generate(cached, prompts[:1], GREEDY)
    assert _ids(first) == want[:1] and _cached_tokens(first[0]) == 0
    rest = generate(cached, prompts[1:], GREEDY)
    assert _ids(rest) == want[1:]
    assert all(_cached_tokens(o) == 36 for o in rest)    # the 9 full pages of the system prompt


def test_seeded_sampling_is_unchanged_by_the_cache(plain, cached):
    system = _toks(29, 2)
    prompts = [system + _toks(3, 200 + i) for i in range(5)]
    params = [_seeded(i) for i in range(5)]
    want = _ids(generate(plain, prompts, params))
    generate(cached, prompts[:1], params[:1])
    assert _ids(generate(cached, prompts, params)) == want


def test_partial_page_and_page_boundary_prefixes(plain, cached):
    base = _toks(16, 3)                            # exactly 4 pages
    prompts = [base,                               # whole prompt cached but for its last page
               base[:10] + _toks(9, 31),           # shares 2 full pages and half of the third
               base + _toks(1, 32),                # shares all 4 pages
               _toks(16, 33)]                      # shares nothing
    want = _ids(generate(plain, prompts, GREEDY))
    generate(cached, [base], GREEDY)
    outs = generate(cached, prompts, GREEDY)
    assert _ids(outs) == want
    assert [_cached_tokens(o) for o in outs] == [12, 8, 16, 0]


def test_requests_sharing_pages_still_being_written(plain, cached):
    """All at once, with a long common prefix that is prefilled in chunks of 16 tokens:
    a request never reads a page before the step writing it was launched."""
    system = _toks(70, 4)
    prompts = [system + _toks(4, 400 + i) for i in range(8)]
    params = [GREEDY if i % 2 else _seeded(i) for i in range(8)]
    want = _ids(generate(plain, prompts, params))
    assert _ids(generate(cached, prompts, params)) == want
    again = generate(cached, prompts, params)      # now every request finds the prefix
    assert _ids(again) == want and all(_cached_tokens(o) >= 68 for o in again)


def test_eviction_under_pressure_keeps_outputs_and_frees_everything(ckpt, plain):
    e = _engine(ckpt, True, kv_pages=41)           # 40 usable pages: room for ~4 requests
    try:
        prompts = [_toks(20, 500 + i % 3) + _toks(6, 600 + i) for i in range(24)]
        want = _ids(generate(plain, prompts, GREEDY))
        got = []
        for i in range(0, 24, 3):                  # waves of 30 pages: the cache must evict
            got += _ids(generate(e, prompts[i:i + 3], GREEDY))
        assert got == want
        cache = e.scheduler.cache
        assert cache.stats.evictions > 0 and cache.stats.hits > 0
        s = e.stats()
        assert s.kv_pages_free == s.kv_pages_total  # cached pages count as free
    finally:
        e.shutdown(0)


def test_disabled_cache_reports_no_cached_tokens(plain):
    system = _toks(37, 1)
    outs = generate(plain, [system + [7], system + [8]], GREEDY)
    assert [_cached_tokens(o) for o in outs] == [0, 0]
    assert plain.scheduler.cache.cached_pages == 0
