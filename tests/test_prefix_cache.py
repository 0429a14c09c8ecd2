"""The prefix cache's bookkeeping on a real (CPU) KV pool: matching, sharing, publishing,
LRU eviction, and the zero-layer promise (a referenced page is never taken)."""

import pytest
import torch

from zerod.engine.spec.hf_config import ModelConfig
from zerod.engine.core.kv_pool import KVPool
from zerod.engine.core.prefix_cache import PrefixCache

PS = 4


def _pool(pages: int) -> KVPool:
    mc = ModelConfig.__new__(ModelConfig)
    mc.num_layers, mc.num_kv_heads, mc.head_dim = 1, 1, 8
    return KVPool(mc, pages, PS, torch.float32, torch.device("cpu"))


def _cache(pages: int = 17) -> PrefixCache:
    return PrefixCache(_pool(pages))


def test_miss_then_hit_after_publish():
    c = _cache()
    prompt = list(range(10))                      # 2 full pages + 2 tokens
    pages, chain = c.reserve(prompt, 3)
    assert len(pages) == 3 and chain.uids == []
    assert c.match(prompt) == []                  # nothing shareable before its KV is written
    c.publish(chain, pages, prompt, 10)
    assert len(chain.uids) == 2                   # the partial third page is never published
    pages2, chain2 = c.reserve(prompt + [99], 4)
    assert pages2[:2] == pages[:2] and len(set(pages2)) == 4
    assert c.stats.hits == 2 * PS and c.stats.queries == 10 + 11


def test_at_least_one_token_is_computed():
    c = _cache()
    prompt = list(range(8))                       # exactly 2 pages
    pages, chain = c.reserve(prompt, 2)
    c.publish(chain, pages, prompt, 8)
    assert len(c.match(prompt)) == 1              # the last page is recomputed for its logits
    assert len(c.match(prompt + [1])) == 2


def test_chain_depends_on_the_whole_prefix_and_the_root():
    c = _cache()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    pages, chain = c.reserve(a, 3)
    c.publish(chain, pages, a, 9)
    b = [0, 2, 3, 4, 5, 6, 7, 8, 9]               # same second page, different first
    assert c.match(b) == []
    assert c.match(a, root="adapter-x") == []     # another adapter never shares KV
    assert len(c.match(a)) == 2


def test_unreferenced_pages_stay_cached_and_count_as_free():
    c = _cache(9)                                 # 8 usable pages
    p = list(range(17))
    pages, chain = c.reserve(p, 5)
    c.publish(chain, pages, p, 17)
    assert c.free == 3
    c.release(pages)
    assert c.free == 8 and c.cached_pages == 4 and c.evictable_pages == 4
    again, chain2 = c.reserve(p, 5)
    assert again[:4] == pages[:4]


def test_eviction_is_lru_and_never_takes_a_referenced_page():
    c = _cache(9)
    a, b = [1] * 9, [2] * 9
    pa, ca = c.reserve(a, 3)
    c.publish(ca, pa, a, 9)
    pb, cb = c.reserve(b, 3)
    c.publish(cb, pb, b, 9)
    c.release(pa)                                 # a's pages: cached, unreferenced
    # b still runs: its pages are referenced; a fresh request needing all the rest evicts a's
    fresh, _ = c.reserve([7] * 5, 5)
    assert not set(fresh) & set(pb)
    assert c.match(a) == [] and len(c.match(b)) == 2
    assert c.reserve([8] * 5, 1) is None          # b's pages are never taken
    c.release(fresh)
    c.release(pb)
    assert c.free == 8


def test_failed_reservation_changes_nothing():
    c = _cache(5)                                 # 4 usable pages
    p = list(range(9))
    pages, chain = c.reserve(p, 3)
    c.publish(chain, pages, p, 9)
    c.release(pages)
    before = (c.free, c.cached_pages, c.evictable_pages)
    assert c.reserve(p + [5], 6) is None          # needs 2 cached + 4 fresh: 4 usable in all
    assert (c.free, c.cached_pages, c.evictable_pages) == before


def test_concurrent_identical_prefix_keeps_the_second_copy_private():
    c = _cache()
    p = list(range(9))
    pa, ca = c.reserve(p, 3)
    pb, cb = c.reserve(p, 3)                      # admitted before a's KV was written: no hit
    assert not set(pa) & set(pb)
    c.publish(ca, pa, p, 9)
    c.publish(cb, pb, p, 9)                       # same content: b's pages stay private
    c.release(pb)
    assert c.free == 16 - 3 and c.cached_pages == 2
    c.release(pa)
    assert c.free == 16


def test_disabled_cache_is_a_plain_pool():
    c = PrefixCache(_pool(9), enabled=False)
    p = list(range(9))
    pages, chain = c.reserve(p, 3)
    c.publish(chain, pages, p, 9)
    c.release(pages)
    assert c.match(p) == [] and c.cached_pages == 0 and c.free == 8


def test_reset_returns_unreferenced_pages():
    c = _cache(9)
    p = list(range(9))
    pages, chain = c.reserve(p, 3)
    c.publish(chain, pages, p, 9)
    c.release(pages)
    assert c.reset() == 2 and c.cached_pages == 0 and c.pool.free == 8


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_the_books(seed):
    """Random reserve/publish/release: a page is never held twice, and every page is
    either in the pool, cached, or held."""
    import random
    rng = random.Random(seed)
    c = _cache(33)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live = []
    for _ in range(300):
        if live and (rng.random() < 0.4 or c.free < 6):
            pages, chain, prompt = live.pop(rng.randrange(len(live)))
            c.release(pages)
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        got = c.reserve(prompt, c.pool.pages_for(len(prompt) + 3))
        if got is None:
            continue
        pages, chain = got
        held = [p for x in live for p in x[0]]
        shared = set(pages) & set(held)
        assert all(p in c._entry for p in shared)          # only published pages are shared
        c.publish(chain, pages, prompt, rng.choice([len(prompt), len(prompt) // 2]))
        live.append((pages, chain, prompt))
    for pages, _, _ in live:
        c.release(pages)
    assert c.free == 32
