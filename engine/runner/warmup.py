"""Warm-up before READY: every kernel variant, attention plan and allocation that serving can
reach is compiled, planned and run once, so no request pays for a first use.

What makes a first use cost the step thread (and so every stream) hundreds of ms:
- Triton compiles a kernel per specialisation: integer arguments are specialised on == 1
  and on divisibility by 16, and several kernels pick tiles from the token count at
  power-of-two thresholds (LoRA and W8A16 row tiles, split-K, the MoE tile config). One
  count on each side of every power of two up to the prompt budget crosses them all.
- cuDNN builds an attention plan per sequence length and layout; fresh prompts above
  `sdpa_flash_max_len` are padded to a bounded set of lengths (`sdpa_length`) in one
  layout, each warmed here. Its plans are kept per thread: the warm-up runs on the step
  thread (engine.py).
- The caching allocator grows on the largest step; warming it up front keeps cudaMalloc
  (and the device sync of a cudaFree under pressure) out of serving.
Everything reads and writes the KV pool's scratch page 0 only.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..kernels import gemm_table
from ..model.decoder import AttnMeta, sdpa_length
from ..sampling.grammar_mask import apply_bitmask
from ..sampling.logprobs import logprobs_of
from ..sampling.sampler import sample

log = logging.getLogger("zerod.engine")


def key_triton_cache() -> threading.Thread | None:
    """Triton keys its on-disk kernel cache by a hash of its own sources and of its ~400 MB
    compiler library, computed once a process, at its first kernel launch: 0.7 s of a
    warm restart's step thread on the H200 host (docs/perf.md "Step stalls"). hashlib
    releases the GIL, so a thread computes it while the step thread builds the weights and
    the KV pool; join it before the first launch. None where Triton is absent."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    t = threading.Thread(target=triton_key, name="zerod-triton-key", daemon=True)
    t.start()
    return t


# The kernels' token-count thresholds all lie at or below this (LoRA's 256-row decode
# tiles, W8A16's 64-row tiles, the MoE tiles at 16 pairs per expert, 128 experts x top-8):
# past it, a step of more tokens selects no new variant, only more memory (the cap's
# forward covers that).
LADDER_TOP = 4096


def token_ladder(cap: int) -> list[int]:
    """Token counts of one step's prompt rows that cover every kernel variant up to cap:
    1, 2, 3, then 2^k and 2^k + 1 from 16 up to LADDER_TOP, and cap itself."""
    out = {n for n in (1, 2, 3) if n <= cap}
    p = 16
    while p <= min(cap, LADDER_TOP):
        out.add(p)
        if p + 1 <= cap:
            out.add(p + 1)
        p *= 2
    out.add(cap)
    return sorted(out)


def sdpa_buckets(flash_max: int, cap: int) -> list[int]:
    """The padded lengths fresh prompts of flash_max+1 .. cap tokens run SDPA at."""
    out, n = [], flash_max + 1
    while n <= cap:
        m = sdpa_length(n)
        out.append(m)
        n = m + 1
    return out


def unreached(ladder: list[int], tops: set[int]) -> list[int]:
    """The tops t of the ranges (previous top, t] that hold no count of the ladder."""
    out, prev = [], 0
    for t in sorted(tops):
        if not any(prev < n <= t for n in ladder):
            out.append(t)
        prev = t
    return out


class Warmup:
    """Runs the warm-up of one ModelRunner (CUDA only; the CPU has nothing to compile)."""

    def __init__(self, runner) -> None:
        self.r = runner
        self.dev = runner.device

    def _meta(self, n_seqs: int, L: int, prefix: int) -> tuple[torch.Tensor, AttnMeta]:
        """n_seqs sequences of L new tokens after `prefix` cached ones, all on page 0."""
        ps, dev = self.r.ps, self.dev
        T, ctx = n_seqs * L, prefix + L
        pos = torch.arange(prefix, ctx, dtype=torch.int64, device=dev).repeat(n_seqs)
        meta = AttnMeta(slot_mapping=pos % ps,
                        block_tables=torch.zeros(n_seqs, (ctx + ps - 1) // ps, dtype=torch.int32, device=dev),
                        context_lens=torch.full((n_seqs,), ctx, dtype=torch.int32, device=dev),
                        cu_seqlens_q=torch.arange(0, T + 1, L, dtype=torch.int32, device=dev),
                        no_prefix=prefix == 0, seqlens_q=[L] * n_seqs)
        return pos, meta

    def forward_shapes(self) -> list[tuple[int, int, int]]:
        """(sequences, tokens each, cached prefix) of the eager prefill forwards to run."""
        r = self.r
        cap, limit = r.cfg.prefill_token_cap, r.max_model_len
        # the whole budget once, as a fresh prompt: the allocator's peak
        shapes = [(1, cap, 0)] if cap < limit else []
        ladder = token_ladder(min(cap, LADDER_TOP))
        # a tuned table's config serves the counts up to its measured one: one forward in
        # every such range the ladder misses compiles that config too
        shapes += [(1, T, 0) for T in unreached(ladder, self._tuned_counts()) if T < limit and T <= cap]
        for T in ladder:
            for n_seqs in (1, 3, 16, 17):   # Triton specialises the sequence count too
                if T % n_seqs or T // n_seqs < 1:
                    continue
                for prefix in (0, 7):
                    if prefix + T // n_seqs < limit:
                        shapes.append((n_seqs, T // n_seqs, prefix))
        return shapes

    def _tuned_counts(self) -> set[int]:
        """The measured token counts of the device's tuned tables in use: the skinny GEMMs'
        (kernels/gemm_table.py) and, for a mixture of experts, the MoE tiles'."""
        counts = gemm_table.row_counts()
        if any(getattr(L, "moe", None) is not None for L in self.r.model.layers):
            from ..kernels import moe

            for ts, _ in moe.device_table(self.dev).shapes.values():
                counts.update(ts)
        return counts

    @torch.inference_mode()
    def run(self) -> dict:
        """Warm everything; returns what it ran (for the start log and the tests)."""
        r, t0 = self.r, time.monotonic()
        shapes = sorted(set(self.forward_shapes()), key=lambda s: -s[0] * s[1])   # the peak first
        # one layer of each kind launches every variant the whole model does; the
        # activations of a layer are the allocator's peak, reached as well
        kinds = r.model.layer_kinds()
        for n_seqs, L, prefix in shapes:
            pos, meta = self._meta(n_seqs, L, prefix)
            T = n_seqs * L
            for rows in (None, torch.zeros(T, dtype=torch.int32, device=self.dev)) if r.lora else (None,):
                hidden = r._forward(torch.zeros(T, dtype=torch.int64, device=self.dev), pos, meta, rows, kinds)
                r.model.logits(hidden[L - 1::L])
        if r.cuda:
            torch.cuda.synchronize(self.dev)
        self._sampling()
        t1 = time.monotonic()
        buckets = self._sdpa_plans()
        if r.cuda:
            torch.cuda.synchronize(self.dev)
        t2 = time.monotonic()
        log.info("warmed %d prefill shapes in %.1fs (through layers %s of %d) and %d attention plans in %.1fs",
                 len(shapes), t1 - t0, kinds, len(r.model.layers), len(buckets), t2 - t1)
        return {"shapes": shapes, "sdpa_buckets": buckets, "seconds": t2 - t0}

    def _sampling(self) -> None:
        """Every sampling rule once on the rows of a step (greedy, random, top-k/top-p,
        min-p, min_tokens, penalties, logit_bias, logprobs, a grammar mask): their kernels
        load on first launch (CUDA's lazy module loading), which a request would pay."""
        r, dev = self.r, self.dev
        B = 3
        slots = torch.full((B,), r.pad_slot, dtype=torch.int64, device=dev)
        logits = r.model.logits(torch.zeros(B, r.model.mc.hidden_size, dtype=r.model.dtype, device=dev))
        V = logits.shape[1]
        rows = torch.arange(B, device=dev)
        lens = torch.ones(B, dtype=torch.int64, device=dev)
        x = r.tables.pen.apply(logits, rows, slots, lens, lens, 1)
        x = r.tables.pen.add_bias(x, rows, slots)
        x = apply_bitmask(x, rows, torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=dev))
        gen = torch.zeros(B, dtype=torch.int64, device=dev)
        for n_random, n_filter, rules in ((0, 0, False), (B, 0, False), (B, B, False), (B, B, True)):
            tok = sample(x, r.tables.temperature.index_select(0, slots) + 1.0, r.tables.top_p.index_select(0, slots) * 0.9,
                         r.tables.top_k.index_select(0, slots) + 5, r.tables.seed.index_select(0, slots), gen,
                         n_random=n_random, n_filter=n_filter,
                         suppress_ids=r.tables.eos if rules else None,
                         suppress_rows=(gen < 1) if rules else None,
                         min_p=r.tables.min_p.index_select(0, slots) + 0.1 if rules else None)
            logprobs_of(x, tok, 5)

    def _sdpa_plans(self) -> list[int]:
        """One layer's attention at every padded length a fresh prompt can take (cuDNN keys
        its plans on shapes and strides; exact and padded lengths share a layout)."""
        r = self.r
        model = r.model
        if not r.cuda or not model.layers:
            return []
        flash_max = model.tuning.sdpa_flash_max_len
        cap = min(r.cfg.prefill_token_cap, r.max_model_len - 1)
        buckets = sdpa_buckets(flash_max, cap) if model.tuning.sdpa_pad_lengths else []
        L0 = model.layers[0]
        hidden = model.mc.hidden_size
        for m in buckets:
            n = min(m, cap)
            if n <= flash_max:
                continue
            pos, meta = self._meta(1, n, 0)
            x = torch.randn(n, hidden, dtype=model.dtype, device=self.dev)
            model._attention(L0, x, pos, r.pool.kv[0], meta)
        return buckets
