"""Device side of a step: input staging, the prefill and decode forwards, sampling,
decode CUDA graphs per batch-size bucket, and the copy of sampled ids into the host ring.

Everything a request needs on the device is written once, when it is admitted (its
block-table row and sampling parameters live in per-slot device tables), so a decode step
only ships two int64 numbers per request (slot, position) in one pinned, non-blocking
copy. The sampled token of each request stays on the device (`last_tokens[slot]`) and is
the next decode input: the CPU never needs a token back to schedule the next step, so it
prepares and launches step N+1 while step N runs. No host sync inside a step (CUDA), the
same code path on the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from . import ops
from .config import EngineConfig
from .hf_config import ModelConfig, cos_sin_cache
from .kv_pool import KVPool
from .model import AttnMeta, LlamaModel
from .output import HostRing
from .request import Request
from .sampler import row_class, sample

log = logging.getLogger("zerod.engine")


@dataclass
class Chunk:
    req: Request
    start: int   # first prompt position of the chunk
    n: int       # tokens in the chunk

    @property
    def completes(self) -> bool:
        return self.start + self.n == self.req.prompt_len


def _cls(r: Request) -> int:
    p = r.params
    return row_class(p.temperature, p.top_k, p.top_p)


# A prompt that arrives alone (the idle-TTFT case) is prefilled by a CUDA graph captured
# for a padded token count: eager, its ~400 launches (a third of them Triton, each costing
# tens of microseconds of Python) take longer than the GPU work of a short prompt.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)


def graph_buckets(max_bs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = 16
    while b <= max_bs:
        out.append(b)
        b += 16 if b < 128 else 32
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, model: LlamaModel, pool: KVPool,
                 device: torch.device, max_model_len: int, eos_ids: list[int]):
        self.cfg, self.mc, self.model, self.pool, self.device = cfg, mc, model, pool, device
        self.cuda = device.type == "cuda"
        self.ps = pool.page_size
        self.max_model_len = max_model_len
        self.W = (max_model_len + self.ps - 1) // self.ps
        S = cfg.max_num_seqs
        self.pad_slot = S           # row S of the slot tables: zeros -> scratch page 0
        dev = device
        model.cos_sin = cos_sin_cache(mc, max_model_len + 1, model.dtype, dev)
        # per-slot device tables (written at admission)
        self.block_table = torch.zeros(S + 1, self.W, dtype=torch.int32, device=dev)
        self.prompt_len = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.top_k = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.min_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(S + 1, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(S + 1, dtype=torch.float32, device=dev)
        self.last_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.eos = torch.tensor(eos_ids or [0], dtype=torch.int64, device=dev)
        # host ring of sampled ids + pinned input staging, one per ring slot
        self.ring = HostRing(cfg.ring_depth, S, device)
        T = cfg.prefill_token_cap
        # admissions: 3 ints per page + 5 per request; prefill: 3 per token + 5 per chunk
        # (chunks <= tokens); decode: 2 per request
        self.int_cap = 3 * pool.num_pages + 8 * S + 8 * T + 16
        self.flt_cap = 2 * S
        pin = self.cuda
        self.stage_i = [torch.zeros(self.int_cap, dtype=torch.int64, pin_memory=pin) for _ in range(cfg.ring_depth)]
        self.stage_f = [torch.zeros(self.flt_cap, dtype=torch.float32, pin_memory=pin) for _ in range(cfg.ring_depth)]
        self.dev_i = torch.zeros(self.int_cap, dtype=torch.int64, device=dev)
        self.dev_f = torch.zeros(self.flt_cap, dtype=torch.float32, device=dev)
        # decode graph buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.g_slots = torch.full((S,), self.pad_slot, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(S, dtype=torch.int64, device=dev)
        self.buckets: list[int] = []
        # prefill graph buffers: a padded batch of two sequences, the prompt (L tokens) and
        # a dummy one (T - L tokens, block-table row of zeros: it reads and writes only the
        # scratch page 0), so the shapes are fixed per T and the real rows are exact.
        Tp = max((t for t in PREFILL_GRAPH_TOKENS
                  if t <= cfg.max_num_batched_tokens and t < max_model_len), default=0)
        self.pgraphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pad_prefill = False   # set when the graphs are captured (tests set it on the CPU)
        self.p_toks = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_pos = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_smap = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_cu = torch.zeros(3, dtype=torch.int32, device=dev)
        self.p_ctx = torch.zeros(2, dtype=torch.int32, device=dev)
        self.p_bt = torch.zeros(2, (Tp + self.ps - 1) // self.ps, dtype=torch.int32, device=dev)
        self.p_sidx = torch.zeros(1, dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ staging
    def _ship(self, ring_idx: int, ints: list[np.ndarray], flts: list[np.ndarray]):
        """One pinned, non-blocking H2D copy for the ints and one for the floats;
        returns device views in the same order."""
        sizes = [a.size for a in ints]
        n = sum(sizes)
        out_i: list[torch.Tensor] = []
        if n:
            si = self.stage_i[ring_idx]
            np.concatenate(ints, out=si.numpy()[:n])
            self.dev_i[:n].copy_(si[:n], non_blocking=True)
            off = 0
            for s in sizes:
                out_i.append(self.dev_i[off:off + s])
                off += s
        fsz = [a.size for a in flts]
        m = sum(fsz)
        out_f: list[torch.Tensor] = []
        if m:
            sf = self.stage_f[ring_idx]
            np.concatenate(flts, out=sf.numpy()[:m])
            self.dev_f[:m].copy_(sf[:m], non_blocking=True)
            off = 0
            for s in fsz:
                out_f.append(self.dev_f[off:off + s])
                off += s
        return out_i, out_f

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, ring_idx: int, admitted: list[Request], chunks: list[Chunk],
             decodes: list[Request]) -> list[Request]:
        """Launch admissions, prefill chunks and one decode; sampled ids land in
        ring.tokens[ring_idx]. Returns the requests in ring-row order."""
        ints: list[np.ndarray] = []
        flts: list[np.ndarray] = []
        # admissions: block-table rows (ragged) + per-slot params
        A = len(admitted)
        if A:
            npg = np.fromiter((len(r.pages) for r in admitted), dtype=np.int64, count=A)
            a_slots = np.fromiter((r.slot for r in admitted), dtype=np.int64, count=A)
            rows = np.repeat(a_slots, npg)
            starts = np.repeat(np.cumsum(npg) - npg, npg)
            cols = np.arange(int(npg.sum()), dtype=np.int64) - starts
            vals = np.fromiter((p for r in admitted for p in r.pages), dtype=np.int64, count=int(npg.sum()))
            par = np.array([(r.prompt_len, r.params.top_k, r.seed, r.params.min_tokens) for r in admitted],
                           dtype=np.int64).T.reshape(-1)
            ints += [a_slots, rows, cols, vals, par]
            flts += [np.array([r.params.temperature for r in admitted], dtype=np.float32),
                     np.array([r.params.top_p for r in admitted], dtype=np.float32)]
        # prefill chunks
        decodes = sorted(decodes, key=_cls)     # sampling wants rows grouped by class
        C = len(chunks)
        # Only on an idle engine: with decodes running, a padded prefill per step for each
        # trickling arrival measured worse on the H200 (200 streams: TTFT p99 170 -> 422 ms).
        padT = 0 if decodes else self._prefill_bucket(chunks)
        if padT:
            c = chunks[0]
            L, ps = c.n, self.ps
            dummy = np.arange(padT - L, dtype=np.int64)
            toks = np.zeros(padT, dtype=np.int64)
            toks[:L] = c.req.prompt_ids
            pos = np.concatenate([np.arange(L, dtype=np.int64), dummy])
            pages = np.asarray(c.req.pages, dtype=np.int64)[np.arange(L) // ps]
            smap = np.concatenate([pages * ps + pos[:L] % ps, dummy % ps])
            cu = np.array([0, L, padT], dtype=np.int64)
            ctx = np.array([L, padT - L], dtype=np.int64)
            p_slots = np.array([c.req.slot], dtype=np.int64)
            done = [0]
            s_idx = np.array([L - 1], dtype=np.int64)
            ints += [toks, pos, smap, cu, ctx, p_slots, s_idx, p_slots]
        elif C:
            toks = np.concatenate([np.asarray(c.req.prompt_ids[c.start:c.start + c.n], dtype=np.int64) for c in chunks])
            pos = np.concatenate([np.arange(c.start, c.start + c.n, dtype=np.int64) for c in chunks])
            pages = np.concatenate([np.asarray(c.req.pages, dtype=np.int64)[
                np.arange(c.start, c.start + c.n) // self.ps] for c in chunks])
            smap = pages * self.ps + pos % self.ps
            lens = np.fromiter((c.n for c in chunks), dtype=np.int64, count=C)
            cu = np.zeros(C + 1, dtype=np.int64)
            np.cumsum(lens, out=cu[1:])
            ctx = np.fromiter((c.start + c.n for c in chunks), dtype=np.int64, count=C)
            p_slots = np.fromiter((c.req.slot for c in chunks), dtype=np.int64, count=C)
            done = sorted((i for i, c in enumerate(chunks) if c.completes), key=lambda i: _cls(chunks[i].req))
            s_idx = cu[1:][done] - 1
            s_slots = p_slots[done]
            ints += [toks, pos, smap, cu, ctx, p_slots, s_idx, s_slots]
        B = len(decodes)
        if B:
            d_slots = np.fromiter((r.slot for r in decodes), dtype=np.int64, count=B)
            d_pos = np.fromiter((r.prompt_len + r.num_scheduled - 1 for r in decodes), dtype=np.int64, count=B)
            ints += [d_slots, d_pos]
        di, df = self._ship(ring_idx, ints, flts)
        k = 0
        if A:
            a_slots_d, rows_d, cols_d, vals_d, par_d = di[0:5]
            k = 5
            self.block_table.index_put_((rows_d, cols_d), vals_d.to(torch.int32))
            par_d = par_d.view(4, A)
            self.prompt_len.index_copy_(0, a_slots_d, par_d[0])
            self.top_k.index_copy_(0, a_slots_d, par_d[1])
            self.seed.index_copy_(0, a_slots_d, par_d[2])
            self.min_tokens.index_copy_(0, a_slots_d, par_d[3])
            self.temperature.index_copy_(0, a_slots_d, df[0])
            self.top_p.index_copy_(0, a_slots_d, df[1])
        out_rows: list[Request] = []
        n_out = 0
        tokens_ring = self.ring.tokens[ring_idx]
        if C:
            toks_d, pos_d, smap_d, cu_d, ctx_d, pslots_d, sidx_d, sslots_d = di[k:k + 8]
            k += 8
        if padT:
            logits = self._prefill_padded(padT, toks_d, pos_d, smap_d, cu_d, ctx_d, pslots_d, sidx_d)
            tok = self._sample(logits, sslots_d, torch.zeros_like(sslots_d), [chunks[0].req])
            self.last_tokens.index_copy_(0, sslots_d, tok)
            tokens_ring[:1].copy_(tok, non_blocking=True)
            n_out = 1
            out_rows.append(chunks[0].req)
        elif C:
            w = max((c.start + c.n + self.ps - 1) // self.ps for c in chunks)
            meta = AttnMeta(slot_mapping=smap_d, block_tables=self.block_table[pslots_d, :w],
                            context_lens=ctx_d.to(torch.int32), cu_seqlens_q=cu_d.to(torch.int32),
                            no_prefix=all(c.start == 0 for c in chunks),
                            seqlens_q=[c.n for c in chunks])
            hidden = self.model(toks_d, pos_d, self.pool.kv, meta)
            if done:
                logits = self.model.logits(hidden.index_select(0, sidx_d))
                tok = self._sample(logits, sslots_d, torch.zeros_like(sslots_d), [chunks[i].req for i in done])
                self.last_tokens.index_copy_(0, sslots_d, tok)
                tokens_ring[:len(done)].copy_(tok, non_blocking=True)
                n_out = len(done)
                out_rows += [chunks[i].req for i in done]
        if B:
            slots_d, pos_d = di[k:k + 2]
            logits = self._decode_logits(B, slots_d, pos_d, decodes)
            gen = pos_d - self.prompt_len.index_select(0, slots_d) + 1
            tok = self._sample(logits, slots_d, gen, decodes)
            self.last_tokens.index_copy_(0, slots_d, tok)
            tokens_ring[n_out:n_out + B].copy_(tok, non_blocking=True)
            out_rows += decodes
        return out_rows

    # ------------------------------------------------------------------ padded prefill
    def _prefill_bucket(self, chunks: list[Chunk]) -> int:
        """The padded token count for a lone, whole, uncached prompt; 0 = the general path."""
        if not self.pad_prefill or len(chunks) != 1:
            return 0
        c = chunks[0]
        if c.start != 0 or not c.completes:
            return 0
        return next((t for t in PREFILL_GRAPH_TOKENS if t > c.n and t <= self.p_toks.numel()), 0)

    def _prefill_padded(self, T: int, toks, pos, smap, cu, ctx, pslots, sidx) -> torch.Tensor:
        self.p_toks[:T].copy_(toks)
        self.p_pos[:T].copy_(pos)
        self.p_smap[:T].copy_(smap)
        self.p_cu.copy_(cu)
        self.p_ctx.copy_(ctx)
        w = (T + self.ps - 1) // self.ps
        self.p_bt[0, :w].copy_(self.block_table.index_select(0, pslots)[0, :w])
        self.p_sidx.copy_(sidx)
        if T in self.pgraphs:
            g, out = self.pgraphs[T]
            g.replay()
            return out
        return self._prefill_padded_forward(T)

    def _prefill_padded_forward(self, T: int) -> torch.Tensor:
        w = (T + self.ps - 1) // self.ps
        meta = AttnMeta(slot_mapping=self.p_smap[:T], block_tables=self.p_bt[:, :w],
                        context_lens=self.p_ctx, cu_seqlens_q=self.p_cu)
        hidden = self.model(self.p_toks[:T], self.p_pos[:T], self.pool.kv, meta)
        return self.model.logits(hidden.index_select(0, self.p_sidx))

    def _capture_prefill_graphs(self, pool) -> None:
        """A graph per padded token count, captured on a dummy prompt of one token."""
        for T in (t for t in PREFILL_GRAPH_TOKENS if t <= self.p_toks.numel()):
            self.p_toks[:T].zero_()
            self.p_pos[:T].copy_(torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device),
                                            torch.arange(T - 1, dtype=torch.int64, device=self.device)]))
            self.p_smap[:T].copy_(self.p_pos[:T] % self.ps)
            self.p_cu.copy_(torch.tensor([0, 1, T], dtype=torch.int32))
            self.p_ctx.copy_(torch.tensor([1, T - 1], dtype=torch.int32))
            self.p_bt.zero_()
            self.p_sidx.zero_()
            for _ in range(2):  # Triton compiles / autotunes outside the capture
                self._prefill_padded_forward(T)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._prefill_padded_forward(T)
            pool = g.pool()
            self.pgraphs[T] = (g, out)
        self.pad_prefill = bool(self.pgraphs)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, gen: torch.Tensor,
                reqs: list[Request]) -> torch.Tensor:
        classes = [_cls(r) for r in reqs]      # reqs are sorted by class
        n_filter = classes.count(0)
        n_random = n_filter + classes.count(1)
        need_min = any(r.params.min_tokens > 0 for r in reqs)
        return sample(logits, self.temperature.index_select(0, slots), self.top_p.index_select(0, slots),
                      self.top_k.index_select(0, slots), self.seed.index_select(0, slots), gen,
                      n_random=n_random, n_filter=n_filter,
                      suppress_ids=self.eos if need_min else None,
                      suppress_rows=(gen < self.min_tokens.index_select(0, slots)) if need_min else None)

    # ------------------------------------------------------------------ decode
    def _decode_forward(self, slots: torch.Tensor, pos: torch.Tensor, w: int) -> torch.Tensor:
        ids = self.last_tokens.index_select(0, slots)
        bt = self.block_table.index_select(0, slots)[:, :w]
        pg = self.block_table.index_select(0, slots).gather(1, (pos // self.ps).unsqueeze(1)).squeeze(1)
        smap = pg.long() * self.ps + pos % self.ps
        meta = AttnMeta(slot_mapping=smap, block_tables=bt, context_lens=(pos + 1).to(torch.int32),
                        cu_seqlens_q=None)
        hidden = self.model(ids, pos, self.pool.kv, meta)
        return self.model.logits(hidden)

    def _decode_logits(self, B: int, slots: torch.Tensor, pos: torch.Tensor,
                       reqs: list[Request]) -> torch.Tensor:
        bucket = next((b for b in self.buckets if b >= B), None)
        if bucket is not None and bucket in self.graphs:
            g, out = self.graphs[bucket]
            self.g_slots[:B].copy_(slots)
            self.g_pos[:B].copy_(pos)
            if bucket > B:
                self.g_slots[B:bucket].fill_(self.pad_slot)
                self.g_pos[B:bucket].zero_()
            g.replay()
            return out[:B]
        if self.cuda and ops.has_kernel("decode_attention"):
            w = self.W   # the kernel reads only the pages it needs; same launch shape as the graphs
        else:
            w = max((r.prompt_len + r.num_scheduled - 1) // self.ps + 1 for r in reqs)
        return self._decode_forward(slots, pos, w)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture decode (embedding -> logits) per batch bucket; on failure stay eager."""
        if not self.cuda or self.cfg.enforce_eager:
            return
        if not ops.has_kernel("decode_attention") and self.W * self.ps > 8192:
            log.warning("no paged decode kernel and max_model_len %d > 8192: decode runs eager",
                        self.max_model_len)
            return
        buckets = graph_buckets(min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs))
        pool = None
        try:
            self.g_slots.fill_(self.pad_slot)
            self.g_pos.zero_()
            for _ in range(2):  # warm up (cuBLAS handles, Triton autotune)
                self._decode_forward(self.g_slots[:buckets[-1]], self.g_pos[:buckets[-1]], self.W)
            torch.cuda.synchronize()
            for bs in reversed(buckets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._decode_forward(self.g_slots[:bs], self.g_pos[:bs], self.W)
                pool = g.pool()
                self.graphs[bs] = (g, out)
            torch.cuda.synchronize()
            self.buckets = buckets
            log.info("captured decode CUDA graphs for batch sizes %s", buckets)
        except Exception as exc:  # noqa: BLE001
            log.warning("CUDA graph capture failed (%s); decode runs eager", exc)
            self.graphs.clear()
            self.buckets = []
            torch.cuda.synchronize()
            return
        if not ops.has_kernel("prefill_attention"):
            return  # the padded batch needs the paged prefill kernel (graph-safe, no host sync)
        try:
            self._capture_prefill_graphs(pool)
            log.info("captured prefill CUDA graphs for %s padded tokens", sorted(self.pgraphs))
        except Exception as exc:  # noqa: BLE001
            log.warning("prefill CUDA graph capture failed (%s); prompts prefill eager", exc)
            self.pgraphs.clear()
            self.pad_prefill = False
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ checks
    @torch.inference_mode()
    def score_last(self, prompt: list[int], split: int) -> torch.Tensor:
        """For tests and device checks, with the step loop not running: float32 logits [V]
        after the last prompt token, computed through all three attention paths: a prefill
        of prompt[:split], a chunked prefill of prompt[split:-1] over that cached prefix,
        then one (eager) decode step for the last token."""
        n = len(prompt)
        if not 1 <= split <= n - 1:
            raise ValueError("need 1 <= split <= len(prompt) - 1")
        pages = self.pool.reserve(self.pool.pages_for(n))
        if pages is None:
            raise RuntimeError("no free KV pages")
        dev, ps = self.device, self.ps
        try:
            table = torch.tensor([pages], dtype=torch.int32, device=dev)

            def meta(a: int, b: int, decode: bool) -> AttnMeta:
                smap = torch.tensor([pages[i // ps] * ps + i % ps for i in range(a, b)], device=dev)
                return AttnMeta(slot_mapping=smap, block_tables=table,
                                context_lens=torch.tensor([b], dtype=torch.int32, device=dev),
                                cu_seqlens_q=None if decode else torch.tensor([0, b - a], dtype=torch.int32, device=dev),
                                no_prefix=a == 0, seqlens_q=[b - a])

            def fwd(a: int, b: int, decode: bool = False) -> torch.Tensor:
                toks = torch.tensor(prompt[a:b], dtype=torch.int64, device=dev)
                pos = torch.arange(a, b, dtype=torch.int64, device=dev)
                return self.model(toks, pos, self.pool.kv, meta(a, b, decode))

            fwd(0, split)
            if split < n - 1:
                fwd(split, n - 1)
            return self.model.logits(fwd(n - 1, n, decode=True))[0]
        finally:
            self.pool.release(pages)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the prefill paths once per Triton specialisation class (a batch or token count
        of 1, a multiple of 16, anything else; with and without a cached prefix), so no kernel
        is compiled while serving. Everything reads and writes the scratch page 0 only."""
        dev, ps = self.device, self.ps
        for n_seqs in (1, 3, 16, 17):
            for L in (1, 5, 16):
                for prefix in (0, 7):
                    T, ctx = n_seqs * L, prefix + L
                    if ctx >= self.max_model_len or T > self.cfg.prefill_token_cap:
                        continue
                    pos = torch.arange(prefix, ctx, dtype=torch.int64, device=dev).repeat(n_seqs)
                    meta = AttnMeta(slot_mapping=pos % ps,
                                    block_tables=torch.zeros(n_seqs, (ctx + ps - 1) // ps, dtype=torch.int32, device=dev),
                                    context_lens=torch.full((n_seqs,), ctx, dtype=torch.int32, device=dev),
                                    cu_seqlens_q=torch.arange(0, T + 1, L, dtype=torch.int32, device=dev),
                                    no_prefix=prefix == 0, seqlens_q=[L] * n_seqs)
                    hidden = self.model(torch.zeros(T, dtype=torch.int64, device=dev), pos, self.pool.kv, meta)
                    self.model.logits(hidden[L - 1::L])
        if self.cuda:
            torch.cuda.synchronize(dev)
