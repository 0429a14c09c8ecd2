"""The scheduler: which requests run in the next step, and what each one runs.

The zero-layer rules:
- Admission is FIFO. The head of the wait line gets a slot (a row of the runner's
  per-request device tables) and KV pages for prompt + max_tokens, or nobody behind it
  is admitted. Nothing is sorted, prioritised, preempted or swapped: a request keeps what
  it was given until it ends, so it can never run out of KV pages half-way.
- The chunk budget is the prompt tokens one step takes. While streams decode it comes from
  the measured cost of a step (step_cost.py): enough for every waiting prompt to get its
  first token by its deadline (target_ttft_ms, more for long prompts), at most what keeps
  the step within target_itl_ms, never below min_prefill_chunk nor above
  max_num_batched_tokens; while nothing decodes it is max_prefill_tokens_idle (a long
  prompt goes in whole).
- Every decoding request gets one token per step (one with a structured-output grammar
  too: its mask is computed while the step's forward runs; structured.py).

A request moves waiting -> prefilling -> decoding and leaves from any of them (done,
stopped, aborted, failed). Admission asks the prefix cache first: the pages of the
longest cached chain of the prompt are shared (not reserved again) and `num_prefilled`
starts past them; once a chunk's step is launched, its full pages are published for the
requests after it (prefix_cache.py). A request with a LoRA adapter also takes its
adapter's device slot at admission (loading it there if needed; none free: it waits, FIFO
as for pages), and its prefix chain is rooted at the adapter (its KV is the adapter's).

Sliding windows: when every layer of the model attends only within its window (Mistral,
Mixtral with sliding_window), a request reserves a ring of pages, the window plus one
step's chunk (`ring_pages`), not its whole context; its block table names the ring's pages
over and over (logical page i is ring page i mod R), so a position's K/V overwrites a page
no query of the step still sees. Prefix caching is off for such models (a ring page holds
different positions over time, so it is never a shareable prompt page).

Used by the step-loop thread only, except `claim_wait_place` (any thread).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

from ..config import EngineConfig
from .kv_pool import KVPool
from ..lora import LoraError, LoraManager
from .prefix_cache import PrefixCache
from .request import Request
from .row_features import ALL, FeatureCounts, Uses
from .step_cost import DEADLINES_CHECKED, Pending, StepCost
from ..tuning import Tuning


@dataclass
class Chunk:
    """Prompt tokens [start, start + n) of a request, prefilled in one step."""
    req: Request
    start: int
    n: int

    @property
    def completes(self) -> bool:
        return self.start + self.n == self.req.prompt_len


@dataclass
class Batch:
    """One step's work: prompt chunks and the requests that decode one token."""
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    uses: Uses = ALL   # the features some request may use (the runner looks for their rows)

    @property
    def masked(self) -> bool:
        """Some request may have a structured-output grammar."""
        return self.uses.grammar

    def __len__(self) -> int:
        return len(self.chunks) + len(self.decodes)

    def requests(self) -> list[Request]:
        return [c.req for c in self.chunks] + self.decodes

    def halves(self) -> tuple[Batch, Batch]:
        """Two batches with half the rows each (to find which row makes a step fail)."""
        mid = len(self) // 2
        c = len(self.chunks)
        m = self.uses
        if mid <= c:
            return Batch(self.chunks[:mid], [], m), Batch(self.chunks[mid:], self.decodes, m)
        k = mid - c
        return Batch(self.chunks, self.decodes[:k], m), Batch([], self.decodes[k:], m)


def ring_window(layer_windows: list[int] | None) -> int:
    """The window a ring of pages must cover: the largest one when every layer slides;
    0 when some layer attends globally (it needs every page) or none slides."""
    return max(layer_windows) if layer_windows and all(layer_windows) else 0


def ring_pages(window: int, chunk_cap: int, page_size: int) -> int:
    """Pages a request holds at once when every layer attends within `window`: the keys
    the step's first query sees (window - 1 before it) and the step's chunk, across page
    boundaries (+1)."""
    return -(-(window + chunk_cap - 1) // page_size) + 1


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: KVPool, loras: LoraManager | None = None,
                 window: int = 0, tuning: Tuning | None = None):
        """window: ring_window of the model (0: every request keeps its whole context);
        tuning: the engine's (the chunk budget's deadlines)."""
        self.cfg = cfg
        self.pool = pool
        self.loras = loras
        self.failed: list[tuple[Request, str]] = []   # refused at admission; the engine reports them
        self.ring = ring_pages(window, cfg.prefill_token_cap, pool.page_size) if window else 0
        self.cache = PrefixCache(pool, enabled=cfg.enable_prefix_caching and not window)
        self.cost = StepCost((tuning or Tuning()).long_prompt_slack)   # fed by the output poller
        self.waiting: collections.deque[Request] = collections.deque()
        self.waiting_tokens = 0           # prompt tokens in the wait line
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.features = FeatureCounts()   # requests here per sampling feature (row_features.py)
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        # Requests submitted and not yet admitted, including those still on their way to
        # the wait line: what the wait-line bound (max_waiting) counts.
        self.num_waiting = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ counts
    def lora_names(self) -> tuple[str, str]:
        """The adapters of the running and of the waiting requests, each comma-separated
        and sorted (vLLM's lora_requests_info labels)."""
        def names(reqs) -> str:
            return ",".join(sorted({r.lora.name for r in reqs if r.lora is not None}))
        return names(itertools.chain(self.prefilling, self.decoding)), names(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def claim_wait_place(self) -> bool:
        """Count one more request for the wait line; False when it is full."""
        with self._lock:
            if self.num_waiting >= self.cfg.max_waiting:
                return False
            self.num_waiting += 1
            return True

    def _left_wait_line(self) -> None:
        with self._lock:
            self.num_waiting -= 1

    # ------------------------------------------------------------------ moves
    def add(self, r: Request) -> None:
        """A submitted request joins the wait line (its place is claimed already)."""
        self.waiting.append(r)
        self.waiting_tokens += r.prompt_len
        self.by_id[r.id] = r
        self.features.add(r)

    def remove(self, r: Request) -> None:
        """r leaves, from wherever it is; its pages and slot go back."""
        if r in self.waiting:
            self.waiting.remove(r)
            self.waiting_tokens -= r.prompt_len
            self._left_wait_line()
        elif r in self.prefilling:
            self.prefilling.remove(r)
        elif r in self.decoding:
            self.decoding.remove(r)
        self._release(r)

    def _release(self, r: Request) -> None:
        if self.by_id.pop(r.id, None) is not None:
            self.features.remove(r)
        if r.released:
            return
        r.released = True
        self.cache.release(list(dict.fromkeys(r.pages)))   # a ring's pages appear many times
        r.pages = []
        if r.lora_slot:
            self.loras.release(r.lora_slot)
            r.lora_slot = 0
        if r.slot >= 0:
            self._free_slots.append(r.slot)
            r.slot = -1

    # ------------------------------------------------------------------ a step
    def schedule(self) -> Batch:
        self._admit()
        if not self.prefilling:
            budget = 0                     # nothing to prefill: no budget to work out
        elif self.decoding:
            budget = self._chunk_budget()
        else:
            budget = self.cfg.prefill_token_cap
        chunks: list[Chunk] = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.prompt_len - r.num_prefilled, budget)
            chunks.append(Chunk(r, r.num_prefilled, n))
            budget -= n
        return Batch(chunks, list(self.decoding), self.features.uses())

    def _chunk_budget(self) -> int:
        cfg = self.cfg
        now = time.monotonic()
        pending, counted = [], 0
        for r in itertools.islice(itertools.chain(self.prefilling, self.waiting), DEADLINES_CHECKED):
            pending.append(Pending(r.prompt_len - r.num_prefilled, now - r.arrival, r.prompt_len))
            counted += pending[-1].tokens
        if len(pending) == DEADLINES_CHECKED:
            # the rest of the line at once, due by its last request's deadline
            rest = sum(r.prompt_len - r.num_prefilled for r in self.prefilling) + self.waiting_tokens - counted
            if rest > 0:
                tail = self.waiting[-1] if self.waiting else self.prefilling[-1]
                pending.append(Pending(rest, now - tail.arrival, tail.prompt_len))
        return self.cost.chunk_budget(len(self.decoding), pending, cap=cfg.max_num_batched_tokens,
                                      min_chunk=min(cfg.min_prefill_chunk, cfg.max_num_batched_tokens),
                                      target_itl=cfg.target_itl_ms / 1000,
                                      target_ttft=cfg.target_ttft_ms / 1000)

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            r = self.waiting[0]
            if self._lead_prefilling(r):
                break                      # its prompt's pages come from its lead next step
            # a repetition penalty reads the whole prompt from the token history, and prompt
            # logprobs its hidden states, which only a prefill makes: such a request
            # prefills all of it (its own cache root: no hit); an adapter's KV is its own
            p = r.params
            root = r.id if p.repetition_penalty != 1.0 or p.prompt_logprobs is not None else (
                ("lora", r.lora.uid) if r.lora is not None else None)
            lora_slot = self._lora_slot(r)
            if lora_slot is None:
                break                      # every adapter slot is held: FIFO, wait
            if lora_slot < 0:
                continue                   # refused (its adapter could not be loaded)
            span = self.pool.pages_for(r.prompt_len + r.max_tokens)
            got = self.cache.reserve(r.prompt_ids, min(span, self.ring) if self.ring else span, root)
            if got is None:
                if lora_slot:
                    self.loras.release(lora_slot)
                break                      # FIFO: nobody overtakes the head of the line
            r.lora_slot = lora_slot
            r.scheduled_at = time.monotonic()
            self.waiting.popleft()
            self.waiting_tokens -= r.prompt_len
            self._left_wait_line()
            r.pages, r.chain = got
            if len(r.pages) < span:        # a ring: the block table's every page, mod its length
                r.pages = [r.pages[i % len(r.pages)] for i in range(span)]
            r.num_prefilled = r.num_cached = len(r.chain.uids) * self.pool.page_size
            r.slot = self._free_slots.pop()
            self.prefilling.append(r)

    def _lora_slot(self, r: Request) -> int | None:
        """The device slot of r's adapter (0: none; None: no slot free now; -1: r is
        refused, out of the wait line and on self.failed)."""
        if r.lora is None:
            return 0
        try:
            return self.loras.acquire(r.lora)
        except LoraError as exc:
            self.waiting.popleft()
            self.waiting_tokens -= r.prompt_len
            self._left_wait_line()
            self._release(r)
            self.failed.append((r, str(exc)))
            return -1

    def _lead_prefilling(self, r: Request) -> bool:
        """A sibling (n > 1) waits while the request it follows is still prefilling the
        same prompt: admitted after, it gets the prompt's full pages from the prefix cache
        instead of prefilling them again (only the last, partial page is its own)."""
        if r.after is None or not self.cache.enabled:
            return False
        lead = self.by_id.get(r.after)
        return lead is not None and not lead.released and lead.num_prefilled < lead.prompt_len

    def update(self, batch: Batch) -> None:
        """After batch ran: count what it scheduled; requests at max_tokens are done here
        (the poller reports their last token), the others move on or stay."""
        done = False
        for r in batch.decodes:
            r.num_scheduled += 1
            if r.num_scheduled >= r.max_tokens:
                self._release(r)
                done = True
        if done:
            self.decoding = [r for r in self.decoding if not r.released]
        for c in batch.chunks:
            r = c.req
            r.on_device = True
            r.num_prefilled += c.n
            self.cache.publish(r.chain, r.pages, r.prompt_ids, r.num_prefilled)
            if c.completes:
                self.prefilling.remove(r)
                r.num_scheduled = 1        # the prefill sampled the first output token
                if r.num_scheduled >= r.max_tokens:
                    self._release(r)
                else:
                    self.decoding.append(r)
