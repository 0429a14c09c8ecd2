"""Prefix caching over the KV page pool: full pages of prompt KV, found again by content.

A full page is identified by its token chain: the key of page i is (uid of page i-1, the
page's token ids), with the chain rooted at `root` (None for the base model, the adapter's
("lora", uid) for a LoRA request: its KV is that adapter's, never shared with another). Keys are compared exactly (a dict of tuples), so a hit is never a hash
collision. Every published page has a reference count:

- a request that matches a chain takes a reference on each page of it and reserves only the
  rest of its prompt + max_tokens from the pool;
- a page is published (made findable) only after the step that wrote its KV was launched:
  later steps run after it on the same stream, so nobody reads a page before it is written;
- a page nobody references stays cached, on an LRU list, and is evicted only when a
  reservation needs it. Admission counts those pages as free.

The zero-layer promise holds: a referenced page is never evicted, so an admitted request
never loses a page. Only the step-loop thread calls this (no lock of its own).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

from .kv_pool import KVPool


@dataclass
class CacheStats:
    queries: int = 0         # prompt tokens looked up
    hits: int = 0            # of which found cached
    evictions: int = 0       # cached pages reused for a new reservation


@dataclass
class PageChain:
    """One request's view of its pages: uids of the leading pages that are published
    (matched or published by this request), in page order."""
    root: Hashable = None
    uids: list[int] = field(default_factory=list)


class PrefixCache:
    def __init__(self, pool: KVPool, enabled: bool = True):
        self.pool = pool
        self.enabled = enabled
        self.page_size = pool.page_size
        self.stats = CacheStats()
        self._uids = itertools.count(1)
        self._by_key: dict[tuple, int] = {}       # (parent uid or root, tokens) -> uid
        self._page_of: dict[int, int] = {}        # uid -> page
        self._entry: dict[int, tuple[int, tuple]] = {}  # page -> (uid, key), published pages only
        self._refs: dict[int, int] = {}           # published page -> references
        self._lru: OrderedDict[int, None] = OrderedDict()  # published pages with no reference

    # ------------------------------------------------------------------ sizes
    @property
    def free(self) -> int:
        """Pages a reservation can get: the pool's free pages plus evictable cached ones."""
        return self.pool.free + len(self._lru)

    @property
    def cached_pages(self) -> int:
        return len(self._entry)

    @property
    def evictable_pages(self) -> int:
        return len(self._lru)

    # ------------------------------------------------------------------ lookup
    def match(self, prompt_ids: list[int], root: Hashable = None) -> list[int]:
        """uids of the longest published chain that prefixes the prompt. At least one
        prompt token is always left to compute (its logits give the first output token)."""
        if not self.enabled:
            return []
        ps = self.page_size
        uids: list[int] = []
        parent: Hashable = ("root", root)
        for i in range((len(prompt_ids) - 1) // ps):
            uid = self._by_key.get((parent, tuple(prompt_ids[i * ps:(i + 1) * ps])))
            if uid is None:
                break
            uids.append(uid)
            parent = uid
        return uids

    # ------------------------------------------------------------------ reserve / release
    def reserve(self, prompt_ids: list[int], num_pages: int,
                root: Hashable = None) -> tuple[list[int], PageChain] | None:
        """Pages for a request needing num_pages in all: the cached chain of its prompt,
        then fresh pages. None (and nothing changed) when they do not fit."""
        uids = self.match(prompt_ids, root)
        need = num_pages - len(uids)
        # matched pages with no reference are on the LRU list: taking them removes them
        # from what can be evicted for the fresh pages
        idle_hits = sum(1 for u in uids if self._refs[self._page_of[u]] == 0)
        if need > self.pool.free + len(self._lru) - idle_hits:
            return None
        pages = []
        for u in uids:
            p = self._page_of[u]
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1
            pages.append(p)
        pages += self._take(need)
        if self.enabled:
            self.stats.queries += len(prompt_ids)
            self.stats.hits += len(uids) * self.page_size
        return pages, PageChain(root, uids)

    def _take(self, n: int) -> list[int]:
        got = self.pool.reserve(min(n, self.pool.free)) or []
        while len(got) < n:
            got.append(self._evict_lru())
            self.stats.evictions += 1
        return got

    def _evict_lru(self) -> int:
        """Unpublish the least recently used unreferenced page; returns it."""
        p, _ = self._lru.popitem(last=False)
        uid, key = self._entry.pop(p)
        del self._refs[p], self._page_of[uid], self._by_key[key]
        return p

    def release(self, pages: list[int]) -> None:
        """A request is done with its pages: published ones stay cached (evictable once no
        request references them), private ones go back to the pool."""
        private = []
        # the tail of a chain is the least likely to be shared: it goes first on the LRU list
        for p in reversed(pages):
            if p in self._entry:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._lru[p] = None
            else:
                private.append(p)
        self.pool.release(private[::-1])

    # ------------------------------------------------------------------ publish
    def publish(self, chain: PageChain, pages: list[int], prompt_ids: list[int],
                num_written: int) -> None:
        """Make the full prompt pages whose KV is now written (the first num_written prompt
        tokens) findable. A page whose content another request published first stays
        private to this request (released to the pool at the end)."""
        if not self.enabled:
            return
        ps = self.page_size
        full = min(num_written, len(prompt_ids)) // ps
        while len(chain.uids) < full:
            i = len(chain.uids)
            parent = chain.uids[-1] if chain.uids else ("root", chain.root)
            key = (parent, tuple(prompt_ids[i * ps:(i + 1) * ps]))
            uid = self._by_key.get(key)
            if uid is None:
                uid = next(self._uids)
                p = pages[i]
                self._by_key[key] = uid
                self._page_of[uid] = p
                self._entry[p] = (uid, key)
                self._refs[p] = 1
            # else: identical content already published; keep our copy private and follow
            # the published chain, so our later pages hang under the published uid
            chain.uids.append(uid)

    def reset(self) -> int:
        """Forget every unreferenced cached page (returned to the pool); returns how many."""
        pages = [self._evict_lru() for _ in range(len(self._lru))]
        self.pool.release(pages)
        return len(pages)
