"""Device side of a step: input staging, the prefill and decode forwards, sampling,
decode CUDA graphs per batch-size bucket, and the copy of sampled ids into the host ring.

Everything a request needs on the device is written once, in its first step (its
block-table row and sampling parameters live in per-slot device tables), so a decode step
only ships two int64 numbers per request (slot, position). A step's inputs are packed
into named fields of one pinned buffer and shipped in one non-blocking copy. The sampled
token of each request stays on the device (`last_tokens[slot]`) and is the next decode
input: the CPU never needs a token back to schedule the next step, so it prepares and
launches step N+1 while step N runs. No host sync inside a step (CUDA), the same code
path on the CPU.

With LoRA, each slot's adapter slot is one more per-slot table (`lora_slot`): a decode step
gathers its rows' adapters by slot inside the step, so the decode CUDA graphs (captured
twice: with the LoRA path and without, for steps where no row has an adapter) replay for
any mix of adapters; loading an adapter writes into fixed slabs and recaptures nothing.

A step is staged (host: numpy into the pinned buffer; `StepInputs`) and then launched
(device); `last_tokens` is written by the launch's last ops, after everything that can
raise, so a step that fails can be redone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..config import EngineConfig
from ..spec.hf_config import ModelConfig
from ..model.rope import cos_sin_cache
from ..core.kv_pool import KVPool
from ..lora.delta import use_kernels as lora_kernels
from ..lora.slabs import LoraBatch
from ..model.decoder import AttnMeta, LlamaModel
from ..sampling import prompt_logprobs as plp
from ..sampling.logprobs import logprobs_of
from ..core.output import HostRing, LogprobSegment
from ..sampling.penalties import MAX_LOGIT_BIAS, uses_penalty
from ..core.request import Request
from ..core.row_features import Uses
from ..sampling.sampler import sample
from ..core.scheduler import Batch, Chunk
from ..sampling.grammar_mask import GrammarRows, MaskStaging, apply_bitmask

from . import graphs
from .graphs import prefill_graph_for, prefill_graph_sizes, prefill_graph_slots
from .slot_tables import SlotTables
from .staging import (DecodeInputs, LogitRules, LogprobRows, Packer, PrefillInputs, SlotUpload, Staging,
                      StepInputs)
from .warmup import Warmup

log = logging.getLogger("zerod.engine")


def _sample_class(r: Request) -> int:
    return r.sample_class


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, model: LlamaModel, pool: KVPool,
                 device: torch.device, max_model_len: int, eos_ids: list[int],
                 lora: LoraBatch | None = None):
        self.cfg, self.mc, self.model, self.pool, self.device = cfg, mc, model, pool, device
        self.tuning = model.tuning
        self.channel = None         # tensor parallelism, rank 0: tp_channel.StepChannel
        self.lora = lora   # the model's LoRA rows (None: no --enable-lora)
        self.cuda = device.type == "cuda"
        self.ps = pool.page_size
        self.max_model_len = max_model_len
        self.W = (max_model_len + self.ps - 1) // self.ps
        S = cfg.max_num_seqs
        self.pad_slot = S           # row S of the slot tables: zeros -> scratch page 0
        dev = device
        model.cos_sin = cos_sin_cache(mc, max_model_len + 1, model.dtype, dev)
        # per-slot device tables (written in a request's first step)
        self.tables = SlotTables(S, self.W, max_model_len, eos_ids, dev)
        # host ring of sampled ids + pinned input staging, one per ring slot: a step launches
        # only into a free slot, so the slots bound the steps in flight
        depth = min(cfg.ring_depth, self.tuning.steps_in_flight)
        self.ring = HostRing(depth, S, device, prompt_rows=cfg.prefill_token_cap)
        self.masks = MaskStaging(depth, S, device)
        # prefill graph sizes: padded token counts, and the chunks each holds
        self.pgraph_sizes = prefill_graph_sizes(self.tuning, cfg.max_num_batched_tokens, max_model_len,
                                                S if self.tuning.one_forward_mixed_steps else 0)
        self.pgraph_seqs = prefill_graph_slots(self.tuning, self.pgraph_sizes, S)
        G = max(self.pgraph_seqs.values(), default=0)
        T = cfg.prefill_token_cap
        # words: uploads 2.5 per page + 8.5 per request + 451 per logit_bias; prefill 4 per
        # token + 4 per chunk (chunks <= tokens) + 2 per prompt-logprob row (rows <= tokens);
        # decode 2 per request; penalty / bias rows
        # 2 per sampled row; logprob rows 2 per sampled row; grammar rows 1 per sampled
        # row; LoRA: 1 per request + 1 per token; a padded prefill's sequence fields 2 per
        # graph sequence; a decode's row in a prefill forward (one forward a step) 8, and
        # 2 per row of the decode kernel's tail (at most max_num_seqs);
        # + alignment of each field
        self.staging = Staging(3 * pool.num_pages + (15 + 2 + 2 + 1 + 451 + 1 + 8 + 2) * S + 11 * T
                               + 2 * G + 128,
                               depth, dev, self.cuda)
        # decode graph buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.g_slots = torch.full((S,), self.pad_slot, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(S, dtype=torch.int64, device=dev)
        self.buckets: list[int] = []
        # the rows the last launched step's forwards ran, padding included: (the prefill
        # forward's, the decode forward's); a one-forward step's are all the first
        self.forward_rows = (0, 0)
        # prefill graph buffers: a graph of T tokens runs a padded batch of G + 1 sequences
        # (G = pgraph_seqs[T]), the step's chunks (C <= G, each after its cached prefix, if
        # any), G - C empty ones, and a dummy one (the padding: block-table row of zeros, it
        # reads and writes only the scratch page 0), so the shapes are fixed per T and the
        # real rows are exact. The block table has every column of a context: the kernel
        # reads only the pages below each sequence's context length, none for an empty one.
        Tp = max(self.pgraph_sizes, default=0)
        self.pgraphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora_pgraphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pad_prefill = False   # set when the graphs are captured (tests set it on the CPU)
        self.p_toks = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_pos = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_smap = torch.zeros(Tp, dtype=torch.int64, device=dev)
        self.p_lora = torch.zeros(Tp, dtype=torch.int32, device=dev)
        self.p_cu = torch.zeros(G + 2, dtype=torch.int32, device=dev)
        self.p_ctx = torch.zeros(G + 1, dtype=torch.int32, device=dev)
        self.p_bt = torch.zeros(G + 1, self.W, dtype=torch.int32, device=dev)
        # one forward a step: the decode kernel's tail of each graph (_decode_tail rows)
        self.p_dctx = torch.zeros(S, dtype=torch.int32, device=dev)
        self.p_dbt = torch.zeros(S, self.W, dtype=torch.int32, device=dev)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, ring_idx: int, batch: Batch, on_staged: Callable[[], None] | None = None) -> list[Request]:
        """Launch one step: slot tables of requests new on the device, the prefill chunks,
        one decode token per decoding request. Sampled ids land in ring.tokens[ring_idx];
        returns the requests in ring-row order. on_staged: called between staging and
        launching (the engine times the two)."""
        staged = self.stage(ring_idx, batch)
        if on_staged is not None:
            on_staged()
        return self.launch(ring_idx, staged)

    def stage(self, ring_idx: int, batch: Batch) -> StepInputs:
        """Pack the step's inputs into ring slot ring_idx's pinned buffer; one H2D copy."""
        pk = self.staging.packer(ring_idx)
        u = batch.uses
        # sampling wants rows grouped by class (they are when every request has one)
        decodes = batch.decodes if u.one_class is not None else sorted(batch.decodes, key=_sample_class)
        new = [c.req for c in batch.chunks if not c.req.on_device]
        fused = decodes if batch.chunks and decodes and self._one_forward(batch.chunks, decodes, u) else None
        inputs = StepInputs(
            upload=self._stage_upload(pk, new) if new else None,
            prefill=self._stage_prefill(pk, batch.chunks, self.tuning.prefill_graphs_while_decoding or not decodes, u,
                                        fused)
            if batch.chunks else None,
            decode=self._stage_decode(pk, decodes, u) if decodes else None, uses=u)
        if batch.masked:   # structured outputs: the sampled rows that have a mask
            p, d = inputs.prefill, inputs.decode
            (p_g, d_g), inputs.masked = self.masks.plan([p.sample_reqs if p else [], decodes], pk.int64)
            if p_g is not None:
                p.grammar = p_g
            if d_g is not None:
                d.grammar = d_g
        pk.ship()
        inputs.words = pk.used
        return inputs

    def _one_forward(self, chunks: list[Chunk], decodes: list[Request], u: Uses) -> bool:
        """Whether a mixed step runs its chunks and its decodes in one forward (the
        weights read once): `Tuning.one_forward_mixed_steps`, and the rows fit one prefill
        graph (eager only where no graph is captured: the CPU). Not with tensor
        parallelism or prompt logprobs."""
        if not self.tuning.one_forward_mixed_steps or self.channel is not None:
            return False
        if u.prompt_logprobs and any(c.req.params.prompt_logprobs is not None for c in chunks):
            return False
        return not self.pad_prefill or self._prefill_bucket(chunks, len(decodes)) > 0

    def _stage_upload(self, pk: Packer, reqs: list[Request]) -> SlotUpload:
        A = len(reqs)
        npg = np.fromiter((len(r.pages) for r in reqs), dtype=np.int64, count=A)
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=A)
        n = int(npg.sum())
        cols = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(npg) - npg, npg)
        return SlotUpload(
            slots=pk.int64(slots),
            bt_rows=pk.int64(np.repeat(slots, npg)),
            bt_cols=pk.int64(cols),
            bt_pages=pk.int32(np.fromiter((p for r in reqs for p in r.pages), dtype=np.int32, count=n)),
            prompt_len=pk.int64([r.prompt_len for r in reqs]),
            top_k=pk.int64([r.params.top_k for r in reqs]),
            seed=pk.int64([r.seed for r in reqs]),
            min_tokens=pk.int64([r.params.min_tokens for r in reqs]),
            temperature=pk.float32([r.params.temperature for r in reqs]),
            top_p=pk.float32([r.params.top_p for r in reqs]),
            min_p=pk.float32([r.params.min_p for r in reqs]),
            presence=pk.float32([r.params.presence_penalty for r in reqs]),
            frequency=pk.float32([r.params.frequency_penalty for r in reqs]),
            repetition=pk.float32([r.params.repetition_penalty for r in reqs]),
            lora_slot=pk.int32([r.lora_slot for r in reqs]) if self.lora is not None else None,
            **self._stage_bias(pk, [r for r in reqs if r.params.logit_bias]))

    @staticmethod
    def _stage_bias(pk: Packer, reqs: list[Request]) -> dict:
        if not reqs:
            return dict(bias_slots=None, bias_ids=None, bias_vals=None)
        ids = np.zeros((len(reqs), MAX_LOGIT_BIAS), dtype=np.int64)
        vals = np.zeros((len(reqs), MAX_LOGIT_BIAS), dtype=np.float32)
        for i, r in enumerate(reqs):
            b = r.params.logit_bias
            ids[i, :len(b)] = list(b)
            vals[i, :len(b)] = list(b.values())
        return dict(bias_slots=pk.int64([r.slot for r in reqs]),
                    bias_ids=pk.int64(ids.ravel()).view(len(reqs), MAX_LOGIT_BIAS),
                    bias_vals=pk.float32(vals.ravel()).view(len(reqs), MAX_LOGIT_BIAS))

    @staticmethod
    def _stage_rules(pk: Packer, reqs: list[Request], seq_lens, u: Uses) -> LogitRules:
        """The rows (of reqs, in order) with penalties or a logit_bias; seq_lens(r): the
        tokens of r's history when this row samples."""
        pen = [i for i, r in enumerate(reqs) if uses_penalty(r.params)] if u.penalty else []
        bias = [i for i, r in enumerate(reqs) if r.params.logit_bias] if u.bias else []
        return LogitRules(pk.int64(pen) if pen else None,
                          max((seq_lens(reqs[i]) for i in pen), default=0),
                          pk.int64(bias) if bias else None)

    def _stage_prefill(self, pk: Packer, chunks: list[Chunk], pad: bool, u: Uses,
                       decodes: list[Request] | None = None) -> PrefillInputs:
        """The chunks' rows; with `decodes` (one forward a step), a row for every decoding
        request at the end of the forward, whose token the launch takes from the device.
        The rows: the chunks', then (a graph) the padding, then the decodes'."""
        ps = self.ps
        # prompt logprobs read the prompt's hidden rows, which the padded graphs do not return
        want_plp = u.prompt_logprobs and any(c.req.params.prompt_logprobs is not None for c in chunks)
        decodes = decodes or []
        B = len(decodes)
        seq_reqs = [c.req for c in chunks] + decodes
        with_lora = self.lora is not None and any(r.lora_slot for r in seq_reqs)
        padded = self._prefill_bucket(chunks, B) if pad and not want_plp else 0
        C = len(chunks)
        toks = np.concatenate([np.asarray(c.req.prompt_ids[c.start:c.start + c.n], dtype=np.int64)
                               for c in chunks])
        pos = np.concatenate([np.arange(c.start, c.start + c.n, dtype=np.int64) for c in chunks])
        pages = np.concatenate([np.asarray(c.req.pages, dtype=np.int64)[
            np.arange(c.start, c.start + c.n) // ps] for c in chunks])
        lens = np.fromiter((c.n for c in chunks), dtype=np.int64, count=C)
        ctx = np.fromiter((c.start + c.n for c in chunks), dtype=np.int64, count=C)
        n_real = len(toks)   # the prompts' tokens (the penalties' history)
        smap = pages * ps + pos % ps
        cu = np.zeros(C + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        done = sorted((i for i, c in enumerate(chunks) if c.completes),
                      key=lambda i: chunks[i].req.sample_class)
        s_idx = cu[1:][done] - 1
        lora_rows = np.repeat([c.req.lora_slot for c in chunks], lens) if with_lora else None
        if padded:
            # the graph's shapes: empty sequences up to the graph's chunk slots, then the dummy
            # one over the rows left before the decodes', on the scratch page (adapter slot 0)
            G, pad_n = self.pgraph_seqs[padded], padded - n_real - B
            dummy = np.arange(pad_n, dtype=np.int64)
            toks = np.concatenate([toks, np.zeros(pad_n, dtype=np.int64)])
            pos = np.concatenate([pos, dummy])
            smap = np.concatenate([smap, dummy % ps])
            cu = np.concatenate([cu, np.full(G - C, n_real, dtype=np.int64), [n_real + pad_n]])
            ctx = np.concatenate([ctx, np.zeros(G - C, dtype=np.int64), [pad_n]])
            if with_lora:
                lora_rows = np.concatenate([lora_rows, np.zeros(pad_n, dtype=np.int64)])
        decode_rows = decode_ctx = tail_slots = None
        width = int(max(ctx[:C] + ps - 1) // ps)
        if decodes:
            d_pos = np.fromiter((r.prompt_len + r.num_scheduled - 1 for r in decodes), dtype=np.int64, count=B)
            d_pages = np.fromiter((r.pages[p // ps] for r, p in zip(decodes, d_pos.tolist())),
                                  dtype=np.int64, count=B)
            T = len(toks) + B
            decode_rows = pk.int64(np.arange(T - B, T, dtype=np.int64))
            toks = np.concatenate([toks, np.zeros(B, dtype=np.int64)])
            pos = np.concatenate([pos, d_pos])
            smap = np.concatenate([smap, d_pages * ps + d_pos % ps])
            if with_lora:
                lora_rows = np.concatenate([lora_rows, [r.lora_slot for r in decodes]])
            # the decode kernel's rows: a graph's fixed tail (chunk or padding rows first,
            # context 0), else exactly the decodes
            tail = self._decode_tail(padded) if padded else B
            d_ctx = np.zeros(tail, dtype=np.int64)
            d_ctx[tail - B:] = d_pos + 1
            d_slots = np.full(tail, self.pad_slot, dtype=np.int64)
            d_slots[tail - B:] = [r.slot for r in decodes]
            decode_ctx, tail_slots = pk.int32(d_ctx), pk.int64(d_slots)
            width = max(width, int(d_pos.max()) // ps + 1)
        prompt_rows = plp.stage(chunks, cu[:-1], pk.int64) if want_plp else None
        slots_host = np.fromiter((c.req.slot for c in chunks), dtype=np.int64, count=len(chunks))
        # the token history only matters to requests with penalties: record none otherwise
        tok_slots = (pk.int64(np.repeat(slots_host, [c.n for c in chunks]))
                     if u.penalty and any(uses_penalty(c.req.params) for c in chunks) else None)
        sample_reqs = [chunks[i].req for i in done]
        return PrefillInputs(
            tokens=pk.int64(toks), positions=pk.int64(pos), slot_mapping=pk.int64(smap),
            cu_seqlens=pk.int32(cu), context_lens=pk.int32(ctx), slots=pk.int64(slots_host),
            sample_idx=pk.int64(s_idx),
            sample_slots=pk.int64(slots_host[done]),
            sample_reqs=sample_reqs,
            logit_rules=self._stage_rules(pk, sample_reqs, lambda r: r.prompt_len, u),
            logprob_rows=self._stage_logprob_rows(pk, sample_reqs, u),
            tok_slots=tok_slots, n_real=n_real,
            seqlens=lens.tolist(),
            width=width,
            no_prefix=not decodes and all(c.start == 0 for c in chunks),
            padded=padded, prompt_rows=prompt_rows,
            lora_rows=pk.int32(lora_rows) if with_lora else None,
            decode_rows=decode_rows, decode_ctx=decode_ctx, decode_tail_slots=tail_slots)

    def _stage_decode(self, pk: Packer, decodes: list[Request], u: Uses) -> DecodeInputs:
        B = len(decodes)
        return DecodeInputs(
            slots=pk.int64(np.fromiter((r.slot for r in decodes), dtype=np.int64, count=B)),
            positions=pk.int64(np.fromiter((r.prompt_len + r.num_scheduled - 1 for r in decodes),
                                           dtype=np.int64, count=B)),
            reqs=decodes,
            logit_rules=self._stage_rules(pk, decodes, lambda r: r.prompt_len + r.num_scheduled, u),
            logprob_rows=self._stage_logprob_rows(pk, decodes, u),
            width=self._decode_width(decodes),
            lora=self.lora is not None and any(r.lora_slot for r in decodes))

    def _decode_width(self, decodes: list[Request]) -> int:
        """Block-table columns a decode reads: all of them for the paged kernel (one launch
        shape, as the graphs), else the longest request's pages."""
        if self.cuda and self.model.ops.has_kernel("decode_attention"):
            return self.W
        return max((r.prompt_len + r.num_scheduled - 1) // self.ps + 1 for r in decodes)

    @staticmethod
    def _stage_logprob_rows(pk: Packer, reqs: list[Request], u: Uses) -> LogprobRows | None:
        if not u.logprobs:
            return None
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return None
        return LogprobRows(rows, pk.int64(rows), max(reqs[i].params.logprobs for i in rows))

    def launch(self, ring_idx: int, x: StepInputs) -> list[Request]:
        """The device work of a staged step, in stream order; no host sync."""
        if self.channel is not None:   # tensor parallelism: the other ranks run the same forward
            self.channel.send_step(x)
        if x.upload is not None:
            self.tables.write(x.upload)
        ring_tokens = self.ring.tokens[ring_idx]
        segments = self.ring.segments[ring_idx]
        segments.clear()
        self.ring.prompt[ring_idx] = None
        rows: list[Request] = []
        prefill_tok = decode_tok = None
        p, d = x.prefill, x.decode
        # the forwards first, then the sampling: a masked step's masks are computed on the
        # CPU while the GPU runs the forwards (MaskStaging.fill waits for the last step's
        # ids).
        if p is not None and p.tok_slots is not None:   # the penalties' token history
            self.tables.pen.record(p.tok_slots, p.positions[:p.n_real], p.tokens[:p.n_real])
        if p is not None and p.decode_rows is not None:   # one forward: chunks and decodes
            hidden = self.prefill_hidden(p, ring_idx, decode_slots=d.slots)
            p_logits = self._sampled_logits(hidden, p)
            d_logits = self._decode_tail_logits(hidden, d.slots.numel())
            self.forward_rows = (hidden.shape[0], 0)
        else:
            p_logits = self.prefill_logits(p, ring_idx) if p is not None else None
            d_logits = self.decode_logits(d) if d is not None else None
            self.forward_rows = (p.padded or p.tokens.numel() if p is not None else 0,
                                 self._decode_bucket(d.slots.numel()) if d is not None else 0)
        if x.masked is not None:
            self.masks.fill(ring_idx, x.masked)
        if p_logits is not None:
            final = self._logit_rules(p_logits, p.sample_slots, p.logit_rules, seq_lens=None)
            prefill_tok = self._sample(final, p.sample_slots, torch.zeros_like(p.sample_slots),
                                       p.sample_reqs, x.uses, p.grammar)
            ring_tokens[:len(p.sample_reqs)].copy_(prefill_tok, non_blocking=True)
            self._copy_logprobs(ring_idx, 0, p_logits, prefill_tok, p.logprob_rows)
            rows += p.sample_reqs
        if d_logits is not None:
            gen = d.positions - self.tables.prompt_len.index_select(0, d.slots) + 1
            final = self._logit_rules(d_logits, d.slots, d.logit_rules, seq_lens=d.positions + 1)
            decode_tok = self._sample(final, d.slots, gen, d.reqs, x.uses, d.grammar)
            ring_tokens[len(rows):len(rows) + len(d.reqs)].copy_(decode_tok, non_blocking=True)
            self._copy_logprobs(ring_idx, len(rows), d_logits, decode_tok, d.logprob_rows)
            rows += d.reqs
        if self.channel is not None:   # every rank's next decode input
            self.channel.send_tokens(prefill_tok, decode_tok)
        # the next step's decode inputs, written last: a step that raised before here
        # left last_tokens as it was, so it can be redone
        if prefill_tok is not None:
            self.tables.last_tokens.index_copy_(0, x.prefill.sample_slots, prefill_tok)
            if x.prefill.logit_rules.pen_rows is not None:   # a history only where penalties read it
                self.tables.pen.record(x.prefill.sample_slots,
                                self.tables.prompt_len.index_select(0, x.prefill.sample_slots), prefill_tok)
        if decode_tok is not None:
            self.tables.last_tokens.index_copy_(0, x.decode.slots, decode_tok)
            if x.decode.logit_rules.pen_rows is not None:
                self.tables.pen.record(x.decode.slots, x.decode.positions + 1, decode_tok)
        if x.masked is not None:   # their matchers take these ids in the next masked step's fill
            self.masks.launched(ring_tokens, [(i, r) for i, r in enumerate(rows) if r.grammar is not None])
        return rows

    def _copy_logprobs(self, ring_idx: int, row0: int, logits: torch.Tensor, tok: torch.Tensor,
                       lp: LogprobRows | None) -> None:
        """Logprobs of the rows that asked (raw logits: see logprobs.py) into the ring
        after this step's earlier segment, if any; nothing when no row asked."""
        if lp is None:
            return
        vals, ids = logprobs_of(logits.index_select(0, lp.dev).float(), tok.index_select(0, lp.dev), lp.k)
        segs = self.ring.segments[ring_idx]
        val_off = sum(len(s.rows) * (s.k + 1) for s in segs)
        id_off = sum(len(s.rows) * s.k for s in segs)
        self.ring.lp_vals[ring_idx, val_off:val_off + vals.numel()].copy_(vals.reshape(-1), non_blocking=True)
        if ids.numel():
            self.ring.lp_ids[ring_idx, id_off:id_off + ids.numel()].copy_(ids.reshape(-1), non_blocking=True)
        segs.append(LogprobSegment([row0 + i for i in lp.host], lp.k, val_off, id_off))

    def settle(self) -> None:
        """After a step raised part-way: wait for the work it queued, so its pinned buffer
        is not filled again while its copy may still read it (the failure path only)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def prefill_logits(self, p: PrefillInputs, ring_idx: int = -1) -> torch.Tensor | None:
        """The forward of the step's prompt chunks: the raw logits of the rows that complete
        a prompt (None: no chunk does). Every tensor-parallel rank runs it; prompt logprobs
        (rank 0 alone, so refused under tensor parallelism) go to ring slot ring_idx."""
        return self._sampled_logits(self.prefill_hidden(p, ring_idx), p)

    def _decode_tail_logits(self, hidden: torch.Tensor, B: int) -> torch.Tensor:
        """The logits of a one-forward step's decodes, its last B rows. The LM head runs
        over a decode graph's row count that holds them (the rows before are a chunk's,
        padding, or zeros where the forward has fewer rows; their logits dropped), so its
        GEMM meets only the row counts the decode graphs were warmed and captured at: an
        eager GEMM at a row count the warm-up never ran picks a cuBLAS kernel that loads on
        its first launch, after READY."""
        T, m = hidden.shape[0], self._decode_bucket(B)
        rows = hidden[T - m:] if m <= T else torch.cat([hidden.new_zeros(m - T, hidden.shape[1]), hidden])
        return self.model.logits(rows)[m - B:]

    def _sampled_logits(self, hidden: torch.Tensor, p: PrefillInputs) -> torch.Tensor | None:
        if not p.sample_idx.numel():
            return None
        return self.model.logits(hidden.index_select(0, p.sample_idx))

    def prefill_hidden(self, p: PrefillInputs, ring_idx: int = -1,
                       decode_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden rows of the step's prefill forward. With decode_slots (one forward a
        step), rows p.decode_rows take those requests' last sampled tokens, which only the
        device has."""
        if p.padded:
            # a graph's output lives in the prefill graphs' own memory pool: the decode
            # graph replayed after it in the same step cannot overwrite it
            hidden = self._prefill_padded(p, decode_slots)
        else:
            tokens = p.tokens
            if decode_slots is not None:
                tokens = tokens.index_copy(0, p.decode_rows, self.tables.last_tokens.index_select(0, decode_slots))
            meta = AttnMeta(slot_mapping=p.slot_mapping, block_tables=self.tables.block_table[p.slots, :p.width],
                            context_lens=p.context_lens, cu_seqlens_q=p.cu_seqlens,
                            no_prefix=p.no_prefix, seqlens_q=p.seqlens)
            if p.decode_ctx is not None:
                meta.decode_tail = p.decode_ctx.numel()
                meta.decode_block_tables = self.tables.block_table[p.decode_tail_slots, :p.width]
                meta.decode_context_lens = p.decode_ctx
            hidden = self._forward(tokens, p.positions, meta, p.lora_rows)
        if p.prompt_rows is not None:
            self.ring.prompt[ring_idx] = p.prompt_rows
            plp.compute(self.model.logits, hidden, p.prompt_rows, *self.ring.prompt_buffers(ring_idx))
        return hidden

    def _logit_rules(self, logits: torch.Tensor, slots: torch.Tensor, rules: LogitRules,
                     seq_lens: torch.Tensor | None) -> torch.Tensor:
        """Penalties and logit_bias of the rows that have them (seq_lens None: the
        prefill's rows, whose history is their prompt)."""
        if rules.pen_rows is not None:
            s = slots.index_select(0, rules.pen_rows)
            prompt = self.tables.prompt_len.index_select(0, s)
            lens = prompt if seq_lens is None else seq_lens.index_select(0, rules.pen_rows)
            logits = self.tables.pen.apply(logits, rules.pen_rows, s, lens, prompt, rules.pen_width)
        if rules.bias_rows is not None:
            logits = self.tables.pen.add_bias(logits, rules.bias_rows, slots.index_select(0, rules.bias_rows))
        return logits

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                 lora_rows: torch.Tensor | None, layers: list[int] | None = None) -> torch.Tensor:
        """The model's forward; with lora_rows (each token's adapter slot) through the LoRA
        path; layers: only those (a warm-up)."""
        if lora_rows is None:
            return self.model(tokens, positions, self.pool.kv, meta, layers=layers)
        self.lora.set(lora_rows, grouped=lora_kernels(self.device))
        try:
            return self.model(tokens, positions, self.pool.kv, meta, layers=layers)
        finally:
            self.lora.clear()

    # ------------------------------------------------------------------ padded prefill
    def _prefill_bucket(self, chunks: list[Chunk], decodes: int = 0) -> int:
        """The padded token count of a step's chunks (after their cached prefixes, if any)
        and of its decodes' rows when they share the forward; 0 = the general path (eager).
        At least one row of padding: the dummy sequence's."""
        if not self.pad_prefill:
            return 0
        return prefill_graph_for(self.pgraph_seqs, sum(c.n for c in chunks) + decodes, len(chunks))

    def _decode_tail(self, T: int) -> int:
        """The rows at the end of a prefill graph of T tokens that the decode kernel reads
        (one forward a step: every decode fits them; 0: the tuning is off)."""
        return min(self.cfg.max_num_seqs, T) if self.tuning.one_forward_mixed_steps else 0

    def _prefill_padded(self, p: PrefillInputs, decode_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden rows [T, hidden] of the chunks padded to p.padded tokens."""
        T = p.padded
        self.p_toks[:T].copy_(p.tokens)
        if decode_slots is not None:
            self.p_toks.index_copy_(0, p.decode_rows, self.tables.last_tokens.index_select(0, decode_slots))
        self.p_pos[:T].copy_(p.positions)
        self.p_smap[:T].copy_(p.slot_mapping)
        self.p_cu[:p.cu_seqlens.numel()].copy_(p.cu_seqlens)
        self.p_ctx[:p.context_lens.numel()].copy_(p.context_lens)
        # rows past the chunks: stale, never read (their sequences are empty; the dummy's
        # row, the last, stays zero)
        torch.index_select(self.tables.block_table, 0, p.slots, out=self.p_bt[:p.slots.numel()])
        tail = self._decode_tail(T)
        if p.decode_ctx is not None:
            self.p_dctx[:tail].copy_(p.decode_ctx)
            torch.index_select(self.tables.block_table, 0, p.decode_tail_slots, out=self.p_dbt[:tail])
        elif tail:
            self.p_dctx[:tail].zero_()   # no decodes: the tail's rows are the chunks' and padding
        lora = p.lora_rows is not None
        if lora:
            self.p_lora[:T].copy_(p.lora_rows)
        graphs = self.lora_pgraphs if lora else self.pgraphs
        if T not in graphs:
            return self._prefill_padded_forward(T, lora)
        g, hidden = graphs[T]
        g.replay()
        return hidden

    def _prefill_padded_forward(self, T: int, lora: bool = False, layers: list[int] | None = None) -> torch.Tensor:
        tail, G = self._decode_tail(T), self.pgraph_seqs[T]
        meta = AttnMeta(slot_mapping=self.p_smap[:T], block_tables=self.p_bt[:G + 1],
                        context_lens=self.p_ctx[:G + 1], cu_seqlens_q=self.p_cu[:G + 2], decode_tail=tail,
                        decode_block_tables=self.p_dbt[:tail] if tail else None,
                        decode_context_lens=self.p_dctx[:tail] if tail else None)
        return self._forward(self.p_toks[:T], self.p_pos[:T], meta, self.p_lora[:T] if lora else None, layers)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, gen: torch.Tensor,
                reqs: list[Request], u: Uses, grammar: GrammarRows | None = None) -> torch.Tensor:
        if grammar is not None:   # structured outputs: before every other sampling rule
            logits = apply_bitmask(logits, grammar.rows, grammar.masks)
        if u.one_class is None:
            classes = [r.sample_class for r in reqs]      # reqs are sorted by class
            n_filter = classes.count(0)
            n_random = n_filter + classes.count(1)
        else:
            n_filter = len(reqs) if u.one_class == 0 else 0
            n_random = len(reqs) if u.one_class < 2 else 0
        need_min = u.min_tokens and any(r.params.min_tokens > 0 for r in reqs)
        need_min_p = u.min_p and any(r.params.min_p > 0.0 for r in reqs[:n_filter])
        return sample(logits, self.tables.temperature.index_select(0, slots), self.tables.top_p.index_select(0, slots),
                      self.tables.top_k.index_select(0, slots), self.tables.seed.index_select(0, slots), gen,
                      n_random=n_random, n_filter=n_filter,
                      suppress_ids=self.tables.eos if need_min else None,
                      suppress_rows=(gen < self.tables.min_tokens.index_select(0, slots)) if need_min else None,
                      min_p=self.tables.min_p.index_select(0, slots) if need_min_p else None)

    # ------------------------------------------------------------------ decode
    def _decode_forward(self, slots: torch.Tensor, pos: torch.Tensor, w: int,
                        lora: bool = False, layers: list[int] | None = None) -> torch.Tensor:
        ids = self.tables.last_tokens.index_select(0, slots)
        bt = self.tables.block_table.index_select(0, slots)[:, :w]
        pg = self.tables.block_table.index_select(0, slots).gather(1, (pos // self.ps).unsqueeze(1)).squeeze(1)
        smap = pg.long() * self.ps + pos % self.ps
        meta = AttnMeta(slot_mapping=smap, block_tables=bt, context_lens=(pos + 1).to(torch.int32),
                        cu_seqlens_q=None)
        hidden = self._forward(ids, pos, meta, self.tables.lora_slot.index_select(0, slots) if lora else None,
                               layers)
        return self.model.logits(hidden)

    def _decode_bucket(self, B: int) -> int:
        """The rows a decode of B requests runs: the smallest decode graph's that holds
        them, B itself past the largest (eager)."""
        return next((b for b in self.buckets if b >= B), B)

    def decode_logits(self, d: DecodeInputs) -> torch.Tensor:
        """The decode forward (a captured graph per batch bucket, with or without the LoRA
        path); every tensor-parallel rank runs it."""
        B, slots, pos = d.slots.numel(), d.slots, d.positions
        bucket = self._decode_bucket(B)
        graphs = self.lora_graphs if d.lora else self.graphs
        if bucket in graphs:
            g, out = graphs[bucket]
            self.g_slots[:B].copy_(slots)
            self.g_pos[:B].copy_(pos)
            if bucket > B:
                self.g_slots[B:bucket].fill_(self.pad_slot)
                self.g_pos[B:bucket].zero_()
            g.replay()
            return out[:B]
        return self._decode_forward(slots, pos, d.width, d.lora)

    def capture_graphs(self) -> None:
        """Capture the decode and prefill CUDA graphs (graphs.py); on failure stay eager."""
        graphs.capture(self)

    # ------------------------------------------------------------------ checks
    @torch.inference_mode()
    def score_last(self, prompt: list[int], split: int) -> torch.Tensor:
        """For tests and device checks, with the step loop not running: float32 logits [V]
        after the last prompt token, computed through all three attention paths: a prefill
        of prompt[:split], a chunked prefill of prompt[split:-1] over that cached prefix,
        then one (eager) decode step for the last token."""
        n = len(prompt)
        if self.model.tp is not None:
            raise ValueError("score_last runs one process's forward; it has no tensor-parallel form")
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

    def warmup(self) -> dict:
        """Every prefill shape and attention plan serving can reach, run once (warmup.py)."""
        return Warmup(self).run()
