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
from ..sampling.penalties import MAX_LOGIT_BIAS, PenaltyTables, uses_penalty
from ..core.request import Request
from ..core.row_features import Uses
from ..sampling.sampler import sample
from ..core.scheduler import Batch, Chunk
from ..sampling.grammar_mask import GrammarRows, MaskStaging, apply_bitmask

log = logging.getLogger("zerod.engine")


def _sample_class(r: Request) -> int:
    return r.sample_class


# Short prefill forwards run from CUDA graphs captured per padded token count: eager, a
# forward's ~400 launches (a third of them Triton, each costing tens of microseconds of
# Python) take far longer than the GPU work of a few short prompts. The H200 measured an
# eager forward of one to eight 24-token prompts at 20-46 ms of host time, and 6-10 ms more
# with LoRA rows (docs/perf.md "Prefill CUDA graphs"), against a 4-9 ms decode
# step: the prompts of a busy server's arrivals made the step thread the bound. A
# graph takes up to PREFILL_GRAPH_SEQS chunks, each after its cached prefix if any (read
# through the block table, which spans the whole context), padded by a dummy sequence on
# the scratch page; with LoRA rows, a second set of graphs with the LoRA path in them.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512)
PREFILL_GRAPH_SEQS = 32
# Whether steps that also decode take the prefill graphs. On, because a busy server's
# arrivals otherwise prefill eagerly beside every decode and stall it (8 LoRA adapters at
# 200 streams: 89.8 % of the base with it, 68.2 % with graphs for a lone prompt on an idle
# engine only; docs/perf.md "Prefill CUDA graphs"). Off, only an idle engine's prompts do.
PREFILL_GRAPHS_WHILE_DECODING = True


def graph_buckets(max_bs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = 16
    while b <= max_bs:
        out.append(b)
        b += 16 if b < 128 else 32
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


# ---------------------------------------------------------------------- staging

class Staging:
    """One pinned host buffer per ring slot and one device buffer, in 8-byte words.

    A ring slot's buffer is filled again only once the poller has seen that slot's step
    finish, so its copy has been read. The device buffer is shared: each step's copy is
    queued after the previous step's kernels."""

    def __init__(self, words: int, depth: int, device: torch.device, pin: bool):
        self.host = [torch.zeros(words, dtype=torch.int64, pin_memory=pin) for _ in range(depth)]
        self.dev = torch.zeros(words, dtype=torch.int64, device=device)
        self._dev_views = (self.dev, self.dev.view(torch.int32), self.dev.view(torch.float32))
        self._host_views = []
        for h in self.host:
            a = h.numpy()
            self._host_views.append((a, a.view(np.int32), a.view(np.float32)))

    def packer(self, ring_idx: int) -> Packer:
        return Packer(self.host[ring_idx], self._host_views[ring_idx], self._dev_views)


class Packer:
    """Packs one step's inputs field by field. Each call writes the values into the pinned
    buffer and returns the field's device view, which holds them once ship() has queued
    the copy (a view launches nothing; the data arrives in stream order).

    Every field starts on a 16-byte boundary: Triton specialises a kernel on whether each
    pointer argument is 16-byte aligned, so views at odd offsets would compile new variants
    while serving (measured on the H200: 0.7-1 s stalls in the first bursts)."""

    __slots__ = ("host", "h64", "h32", "hf32", "d64", "d32", "df32", "used")

    def __init__(self, host: torch.Tensor, host_views, dev_views):
        self.host = host
        self.h64, self.h32, self.hf32 = host_views
        self.d64, self.d32, self.df32 = dev_views
        self.used = 0                          # words

    def _start(self) -> int:
        """The next 16-byte boundary, in words."""
        self.used += self.used & 1
        return self.used

    def int64(self, values) -> torch.Tensor:
        o, n = self._start(), len(values)
        self.h64[o:o + n] = values
        self.used = o + n
        return self.d64[o:o + n]

    def int32(self, values) -> torch.Tensor:
        o, n = 2 * self._start(), len(values)
        self.h32[o:o + n] = values
        self.used += (n + 1) // 2
        return self.d32[o:o + n]

    def float32(self, values) -> torch.Tensor:
        o, n = 2 * self._start(), len(values)
        self.hf32[o:o + n] = values
        self.used += (n + 1) // 2
        return self.df32[o:o + n]

    def ship(self) -> None:
        if self.used:
            self.d64[:self.used].copy_(self.host[:self.used], non_blocking=True)


@dataclass
class SlotUpload:
    """Slot-table rows of the requests whose first chunk runs in this step."""
    slots: torch.Tensor          # int64 [A]
    bt_rows: torch.Tensor        # int64 [P]: block-table row (slot) of each page
    bt_cols: torch.Tensor        # int64 [P]: its column
    bt_pages: torch.Tensor       # int32 [P]: the page
    prompt_len: torch.Tensor     # int64 [A]
    top_k: torch.Tensor          # int64 [A]
    seed: torch.Tensor           # int64 [A]
    min_tokens: torch.Tensor     # int64 [A]
    temperature: torch.Tensor    # float32 [A]
    top_p: torch.Tensor          # float32 [A]
    min_p: torch.Tensor          # float32 [A]
    presence: torch.Tensor       # float32 [A]
    frequency: torch.Tensor      # float32 [A]
    repetition: torch.Tensor     # float32 [A]
    bias_slots: torch.Tensor | None  # int64 [Ab]: the new requests with a logit_bias
    bias_ids: torch.Tensor | None    # int64 [Ab, MAX_LOGIT_BIAS]
    bias_vals: torch.Tensor | None   # float32 [Ab, MAX_LOGIT_BIAS]
    lora_slot: torch.Tensor | None = None  # int32 [A]: each one's adapter slot (with LoRA)


@dataclass
class PrefillInputs:
    tokens: torch.Tensor         # int64 [T]
    positions: torch.Tensor      # int64 [T]
    slot_mapping: torch.Tensor   # int64 [T]
    cu_seqlens: torch.Tensor     # int32 [C+1]
    context_lens: torch.Tensor   # int32 [C]
    slots: torch.Tensor          # int64 [C]
    sample_idx: torch.Tensor     # int64 [S]: token rows of the chunks that complete a prompt
    sample_slots: torch.Tensor   # int64 [S]: their slots
    sample_reqs: list[Request]   # their requests, grouped by sample class
    logit_rules: LogitRules      # penalties / logit_bias of the sampled rows
    logprob_rows: LogprobRows | None  # the sampled rows that asked for logprobs
    tok_slots: torch.Tensor | None  # int64 [n_real]: the slot of each real prompt token
    #                               (None: no chunk's request uses penalties, no history kept)
    n_real: int                  # tokens that are the prompts' (not padding)
    seqlens: list[int]           # host copy of the chunk lengths
    width: int                   # block-table columns the chunks need
    no_prefix: bool              # every chunk starts at position 0
    padded: int                  # > 0: the chunks padded to this many tokens (a CUDA graph)
    grammar: GrammarRows | None = None  # the sampled rows with a structured-output mask
    prompt_rows: plp.PromptRows | None = None  # the prompt rows whose logprobs were asked for
    lora_rows: torch.Tensor | None = None  # int32 [T]: each token's adapter slot (None: no adapter)


@dataclass
class LogitRules:
    """Which sampled rows get penalties / a logit_bias (None: no row)."""
    pen_rows: torch.Tensor | None    # int64 [P]
    pen_width: int                   # the longest history of those rows
    bias_rows: torch.Tensor | None   # int64 [Q]


@dataclass
class LogprobRows:
    """The sampled rows that asked for logprobs (host list and its device copy)."""
    host: list[int]
    dev: torch.Tensor            # int64 [L]
    k: int                       # the most top alternatives any of them asked for


@dataclass
class DecodeInputs:
    slots: torch.Tensor          # int64 [B]
    positions: torch.Tensor      # int64 [B]
    reqs: list[Request]          # grouped by sample class
    logit_rules: LogitRules
    logprob_rows: LogprobRows | None
    grammar: GrammarRows | None = None  # the rows with a structured-output mask
    width: int = 0               # block-table columns an eager decode reads (no paged kernel)
    lora: bool = False           # some row has a LoRA adapter


@dataclass
class StepInputs:
    upload: SlotUpload | None
    prefill: PrefillInputs | None
    decode: DecodeInputs | None
    uses: Uses                   # the features some request may use (row_features.py)
    masked: list[Request] | None = None   # the sampled rows with a grammar (MaskStaging order)
    words: int = 0               # packed staging words (tensor parallelism ships them)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, model: LlamaModel, pool: KVPool,
                 device: torch.device, max_model_len: int, eos_ids: list[int],
                 lora: LoraBatch | None = None):
        self.cfg, self.mc, self.model, self.pool, self.device = cfg, mc, model, pool, device
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
        self.block_table = torch.zeros(S + 1, self.W, dtype=torch.int32, device=dev)
        self.prompt_len = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.top_k = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.min_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(S + 1, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(S + 1, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(S + 1, dtype=torch.float32, device=dev)
        self.pen = PenaltyTables(S + 1, max_model_len, dev)
        self.last_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.lora_slot = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.eos = torch.tensor(eos_ids or [0], dtype=torch.int64, device=dev)
        # host ring of sampled ids + pinned input staging, one per ring slot
        self.ring = HostRing(cfg.ring_depth, S, device, prompt_rows=cfg.prefill_token_cap)
        self.masks = MaskStaging(cfg.ring_depth, S, device)
        T = cfg.prefill_token_cap
        # words: uploads 2.5 per page + 8.5 per request + 451 per logit_bias; prefill 4 per
        # token + 4 per chunk (chunks <= tokens) + 2 per prompt-logprob row (rows <= tokens);
        # decode 2 per request; penalty / bias rows
        # 2 per sampled row; logprob rows 2 per sampled row; grammar rows 1 per sampled
        # row; LoRA: 1 per request + 1 per token; a padded prefill's sequence fields 2 per
        # graph sequence; + alignment of each field
        self.staging = Staging(3 * pool.num_pages + (15 + 2 + 2 + 1 + 451 + 1) * S + 11 * T
                               + 2 * PREFILL_GRAPH_SEQS + 128,
                               cfg.ring_depth, dev, self.cuda)
        # decode graph buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.g_slots = torch.full((S,), self.pad_slot, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(S, dtype=torch.int64, device=dev)
        self.buckets: list[int] = []
        # prefill graph buffers: a padded batch of G + 1 sequences, the step's chunks (C <=
        # G, each after its cached prefix, if any), G - C empty ones, and a dummy one (the
        # padding: block-table row of zeros, it reads and writes only the scratch page 0),
        # so the shapes are fixed per T and the real rows are exact. The block table has
        # every column of a context: the kernel reads only the pages below each sequence's
        # context length, none for an empty one.
        Tp = max((t for t in PREFILL_GRAPH_TOKENS
                  if t <= cfg.max_num_batched_tokens and t < max_model_len), default=0)
        G = PREFILL_GRAPH_SEQS
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
        inputs = StepInputs(
            upload=self._stage_upload(pk, new) if new else None,
            prefill=self._stage_prefill(pk, batch.chunks, PREFILL_GRAPHS_WHILE_DECODING or not decodes, u)
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

    def _stage_prefill(self, pk: Packer, chunks: list[Chunk], pad: bool, u: Uses) -> PrefillInputs:
        ps = self.ps
        # prompt logprobs read the prompt's hidden rows, which the padded graphs do not return
        want_plp = u.prompt_logprobs and any(c.req.params.prompt_logprobs is not None for c in chunks)
        with_lora = self.lora is not None and any(c.req.lora_slot for c in chunks)
        padded = self._prefill_bucket(chunks) if pad and not want_plp else 0
        C = len(chunks)
        toks = np.concatenate([np.asarray(c.req.prompt_ids[c.start:c.start + c.n], dtype=np.int64)
                               for c in chunks])
        pos = np.concatenate([np.arange(c.start, c.start + c.n, dtype=np.int64) for c in chunks])
        pages = np.concatenate([np.asarray(c.req.pages, dtype=np.int64)[
            np.arange(c.start, c.start + c.n) // ps] for c in chunks])
        smap = pages * ps + pos % ps
        lens = np.fromiter((c.n for c in chunks), dtype=np.int64, count=C)
        cu = np.zeros(C + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        ctx = np.fromiter((c.start + c.n for c in chunks), dtype=np.int64, count=C)
        done = sorted((i for i, c in enumerate(chunks) if c.completes),
                      key=lambda i: chunks[i].req.sample_class)
        s_idx = cu[1:][done] - 1
        n_real = len(toks)
        lora_rows = np.repeat([c.req.lora_slot for c in chunks], lens) if with_lora else None
        if padded:
            # the graph's shapes: empty sequences up to PREFILL_GRAPH_SEQS, then the dummy
            # one, T - n_real tokens on the scratch page (adapter slot 0)
            G, pad_n = PREFILL_GRAPH_SEQS, padded - n_real
            dummy = np.arange(pad_n, dtype=np.int64)
            toks = np.concatenate([toks, np.zeros(pad_n, dtype=np.int64)])
            pos = np.concatenate([pos, dummy])
            smap = np.concatenate([smap, dummy % ps])
            cu = np.concatenate([cu, np.full(G - C, n_real, dtype=np.int64), [padded]])
            ctx = np.concatenate([ctx, np.zeros(G - C, dtype=np.int64), [pad_n]])
            if with_lora:
                lora_rows = np.concatenate([lora_rows, np.zeros(pad_n, dtype=np.int64)])
        prompt_rows = plp.stage(chunks, cu[:-1], pk.int64) if want_plp else None
        slots_host = np.fromiter((c.req.slot for c in chunks), dtype=np.int64, count=len(chunks))
        slots = pk.int64(slots_host)
        # the token history only matters to requests with penalties: record none otherwise
        tok_slots = (pk.int64(np.repeat(slots_host, [c.n for c in chunks]))
                     if u.penalty and any(uses_penalty(c.req.params) for c in chunks) else None)
        sample_reqs = [chunks[i].req for i in done]
        return PrefillInputs(
            tokens=pk.int64(toks), positions=pk.int64(pos), slot_mapping=pk.int64(smap),
            cu_seqlens=pk.int32(cu), context_lens=pk.int32(ctx), slots=slots,
            sample_idx=pk.int64(s_idx),
            sample_slots=pk.int64(slots_host[done]),
            sample_reqs=sample_reqs,
            logit_rules=self._stage_rules(pk, sample_reqs, lambda r: r.prompt_len, u),
            logprob_rows=self._stage_logprob_rows(pk, sample_reqs, u),
            tok_slots=tok_slots, n_real=n_real,
            seqlens=[c.n for c in chunks],
            width=max((c.start + c.n + ps - 1) // ps for c in chunks),
            no_prefix=all(c.start == 0 for c in chunks),
            padded=padded, prompt_rows=prompt_rows,
            lora_rows=pk.int32(lora_rows) if with_lora else None)

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
            self._write_slot_tables(x.upload)
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
            self.pen.record(p.tok_slots, p.positions[:p.n_real], p.tokens[:p.n_real])
        p_logits = self.prefill_logits(p, ring_idx) if p is not None else None
        d_logits = self.decode_logits(d) if d is not None else None
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
            gen = d.positions - self.prompt_len.index_select(0, d.slots) + 1
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
            self.last_tokens.index_copy_(0, x.prefill.sample_slots, prefill_tok)
            if x.prefill.logit_rules.pen_rows is not None:   # a history only where penalties read it
                self.pen.record(x.prefill.sample_slots,
                                self.prompt_len.index_select(0, x.prefill.sample_slots), prefill_tok)
        if decode_tok is not None:
            self.last_tokens.index_copy_(0, x.decode.slots, decode_tok)
            if x.decode.logit_rules.pen_rows is not None:
                self.pen.record(x.decode.slots, x.decode.positions + 1, decode_tok)
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

    def _write_slot_tables(self, u: SlotUpload) -> None:
        self.block_table.index_put_((u.bt_rows, u.bt_cols), u.bt_pages)
        self.prompt_len.index_copy_(0, u.slots, u.prompt_len)
        self.top_k.index_copy_(0, u.slots, u.top_k)
        self.seed.index_copy_(0, u.slots, u.seed)
        self.min_tokens.index_copy_(0, u.slots, u.min_tokens)
        self.temperature.index_copy_(0, u.slots, u.temperature)
        self.top_p.index_copy_(0, u.slots, u.top_p)
        self.min_p.index_copy_(0, u.slots, u.min_p)
        self.pen.presence.index_copy_(0, u.slots, u.presence)
        self.pen.frequency.index_copy_(0, u.slots, u.frequency)
        self.pen.repetition.index_copy_(0, u.slots, u.repetition)
        if u.lora_slot is not None:
            self.lora_slot.index_copy_(0, u.slots, u.lora_slot)
        if u.bias_slots is not None:
            self.pen.bias_ids.index_copy_(0, u.bias_slots, u.bias_ids)
            self.pen.bias_vals.index_copy_(0, u.bias_slots, u.bias_vals)

    def prefill_logits(self, p: PrefillInputs, ring_idx: int = -1) -> torch.Tensor | None:
        """The forward of the step's prompt chunks: the raw logits of the rows that complete
        a prompt (None: no chunk does). Every tensor-parallel rank runs it; prompt logprobs
        (rank 0 alone, so refused under tensor parallelism) go to ring slot ring_idx."""
        if p.padded:
            # a graph's output lives in the prefill graphs' own memory pool: the decode
            # graph replayed after it in the same step cannot overwrite it
            hidden = self._prefill_padded(p)
        else:
            meta = AttnMeta(slot_mapping=p.slot_mapping, block_tables=self.block_table[p.slots, :p.width],
                            context_lens=p.context_lens, cu_seqlens_q=p.cu_seqlens,
                            no_prefix=p.no_prefix, seqlens_q=p.seqlens)
            hidden = self._forward(p.tokens, p.positions, meta, p.lora_rows)
        if p.prompt_rows is not None:
            self.ring.prompt[ring_idx] = p.prompt_rows
            plp.compute(self.model.logits, hidden, p.prompt_rows, *self.ring.prompt_buffers(ring_idx))
        if not p.sample_idx.numel():
            return None
        return self.model.logits(hidden.index_select(0, p.sample_idx))

    def _logit_rules(self, logits: torch.Tensor, slots: torch.Tensor, rules: LogitRules,
                     seq_lens: torch.Tensor | None) -> torch.Tensor:
        """Penalties and logit_bias of the rows that have them (seq_lens None: the
        prefill's rows, whose history is their prompt)."""
        if rules.pen_rows is not None:
            s = slots.index_select(0, rules.pen_rows)
            prompt = self.prompt_len.index_select(0, s)
            lens = prompt if seq_lens is None else seq_lens.index_select(0, rules.pen_rows)
            logits = self.pen.apply(logits, rules.pen_rows, s, lens, prompt, rules.pen_width)
        if rules.bias_rows is not None:
            logits = self.pen.add_bias(logits, rules.bias_rows, slots.index_select(0, rules.bias_rows))
        return logits

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                 lora_rows: torch.Tensor | None) -> torch.Tensor:
        """The model's forward; with lora_rows (each token's adapter slot) through the LoRA path."""
        if lora_rows is None:
            return self.model(tokens, positions, self.pool.kv, meta)
        self.lora.set(lora_rows, grouped=lora_kernels(self.device))
        try:
            return self.model(tokens, positions, self.pool.kv, meta)
        finally:
            self.lora.clear()

    # ------------------------------------------------------------------ padded prefill
    def _prefill_bucket(self, chunks: list[Chunk]) -> int:
        """The padded token count of a step's chunks (after their cached prefixes, if any);
        0 = the general path (eager)."""
        if not self.pad_prefill or len(chunks) > PREFILL_GRAPH_SEQS:
            return 0
        n = sum(c.n for c in chunks)
        return next((t for t in PREFILL_GRAPH_TOKENS if t > n and t <= self.p_toks.numel()), 0)

    def _prefill_padded(self, p: PrefillInputs) -> torch.Tensor:
        """The hidden rows [T, hidden] of the chunks padded to p.padded tokens."""
        T = p.padded
        self.p_toks[:T].copy_(p.tokens)
        self.p_pos[:T].copy_(p.positions)
        self.p_smap[:T].copy_(p.slot_mapping)
        self.p_cu.copy_(p.cu_seqlens)
        self.p_ctx.copy_(p.context_lens)
        # rows past the chunks: stale, never read (their sequences are empty; the dummy's
        # row, the last, stays zero)
        torch.index_select(self.block_table, 0, p.slots, out=self.p_bt[:p.slots.numel()])
        lora = p.lora_rows is not None
        if lora:
            self.p_lora[:T].copy_(p.lora_rows)
        graphs = self.lora_pgraphs if lora else self.pgraphs
        if T not in graphs:
            return self._prefill_padded_forward(T, lora)
        g, hidden = graphs[T]
        g.replay()
        return hidden

    def _prefill_padded_forward(self, T: int, lora: bool = False) -> torch.Tensor:
        meta = AttnMeta(slot_mapping=self.p_smap[:T], block_tables=self.p_bt,
                        context_lens=self.p_ctx, cu_seqlens_q=self.p_cu)
        return self._forward(self.p_toks[:T], self.p_pos[:T], meta, self.p_lora[:T] if lora else None)

    def _capture_prefill_graphs(self) -> None:
        """A graph per padded token count (and per LoRA path), in a memory pool of their
        own, captured on a dummy prompt of one token."""
        G, pool = PREFILL_GRAPH_SEQS, None
        ways = self._graph_sets(self.pgraphs, self.lora_pgraphs)
        for T in (t for t in PREFILL_GRAPH_TOKENS if t <= self.p_toks.numel()):
            self.p_toks[:T].zero_()
            self.p_pos[:T].copy_(torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device),
                                            torch.arange(T - 1, dtype=torch.int64, device=self.device)]))
            self.p_smap[:T].copy_(self.p_pos[:T] % self.ps)
            self.p_lora[:T].zero_()
            self.p_cu.copy_(torch.tensor([0] + [1] * G + [T], dtype=torch.int32))
            self.p_ctx.copy_(torch.tensor([1] + [0] * (G - 1) + [T - 1], dtype=torch.int32))
            self.p_bt.zero_()
            for lora, graphs in ways:
                for _ in range(2):  # Triton compiles / autotunes outside the capture
                    self._prefill_padded_forward(T, lora)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    hidden = self._prefill_padded_forward(T, lora)
                pool = g.pool()
                graphs[T] = (g, hidden)
        self.pad_prefill = bool(self.pgraphs)

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
        return sample(logits, self.temperature.index_select(0, slots), self.top_p.index_select(0, slots),
                      self.top_k.index_select(0, slots), self.seed.index_select(0, slots), gen,
                      n_random=n_random, n_filter=n_filter,
                      suppress_ids=self.eos if need_min else None,
                      suppress_rows=(gen < self.min_tokens.index_select(0, slots)) if need_min else None,
                      min_p=self.min_p.index_select(0, slots) if need_min_p else None)

    # ------------------------------------------------------------------ decode
    def _decode_forward(self, slots: torch.Tensor, pos: torch.Tensor, w: int,
                        lora: bool = False) -> torch.Tensor:
        ids = self.last_tokens.index_select(0, slots)
        bt = self.block_table.index_select(0, slots)[:, :w]
        pg = self.block_table.index_select(0, slots).gather(1, (pos // self.ps).unsqueeze(1)).squeeze(1)
        smap = pg.long() * self.ps + pos % self.ps
        meta = AttnMeta(slot_mapping=smap, block_tables=bt, context_lens=(pos + 1).to(torch.int32),
                        cu_seqlens_q=None)
        hidden = self._forward(ids, pos, meta, self.lora_slot.index_select(0, slots) if lora else None)
        return self.model.logits(hidden)

    def decode_logits(self, d: DecodeInputs) -> torch.Tensor:
        """The decode forward (a captured graph per batch bucket, with or without the LoRA
        path); every tensor-parallel rank runs it."""
        B, slots, pos = d.slots.numel(), d.slots, d.positions
        bucket = next((b for b in self.buckets if b >= B), None)
        graphs = self.lora_graphs if d.lora else self.graphs
        if bucket is not None and bucket in graphs:
            g, out = graphs[bucket]
            self.g_slots[:B].copy_(slots)
            self.g_pos[:B].copy_(pos)
            if bucket > B:
                self.g_slots[B:bucket].fill_(self.pad_slot)
                self.g_pos[B:bucket].zero_()
            g.replay()
            return out[:B]
        return self._decode_forward(slots, pos, d.width, d.lora)

    def _graph_sets(self, plain: dict, with_lora: dict) -> tuple[tuple[bool, dict], ...]:
        """(LoRA path, where its graphs go) for each set a capture makes: the LoRA one only
        with --enable-lora."""
        return ((False, plain), (True, with_lora)) if self.lora is not None else ((False, plain),)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture decode (embedding -> logits) per batch bucket; on failure stay eager."""
        if not self.cuda or self.cfg.enforce_eager:
            return
        if not self.model.ops.has_kernel("decode_attention") and self.W * self.ps > 8192:
            log.warning("no paged decode kernel and max_model_len %d > 8192: decode runs eager",
                        self.max_model_len)
            return
        buckets = graph_buckets(min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs))
        pool = None
        try:
            self.g_slots.fill_(self.pad_slot)
            self.g_pos.zero_()
            ways = self._graph_sets(self.graphs, self.lora_graphs)
            # warm up every bucket eagerly first (cuBLAS handles, and each Triton variant a
            # bucket's size selects: batch 1 is its own specialisation, and the FP8 / LoRA
            # kernels pick tiles by rows), so nothing compiles while a graph is captured
            for lora, _ in ways:
                for bs in [buckets[-1]] + buckets:
                    self._decode_forward(self.g_slots[:bs], self.g_pos[:bs], self.W, lora)
            torch.cuda.synchronize()
            for lora, graphs in ways:
                for bs in reversed(buckets):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        out = self._decode_forward(self.g_slots[:bs], self.g_pos[:bs], self.W, lora)
                    pool = g.pool()
                    graphs[bs] = (g, out)
            torch.cuda.synchronize()
            self.buckets = buckets
            log.info("captured decode CUDA graphs for batch sizes %s", buckets)
        except Exception as exc:  # noqa: BLE001
            if self.model.tp is not None:   # the ranks must all replay or all run eager
                raise
            log.warning("CUDA graph capture failed (%s); decode runs eager", exc)
            self.graphs.clear()
            self.lora_graphs.clear()
            self.buckets = []
            torch.cuda.synchronize()
            return
        if not self.model.ops.has_kernel("prefill_attention"):
            return  # the padded batch needs the paged prefill kernel (graph-safe, no host sync)
        try:
            self._capture_prefill_graphs()
            log.info("captured prefill CUDA graphs for %s padded tokens, up to %d prompt chunks%s",
                     sorted(self.pgraphs), PREFILL_GRAPH_SEQS, " (and with LoRA rows)" if self.lora_pgraphs else "")
        except Exception as exc:  # noqa: BLE001
            if self.model.tp is not None:
                raise
            log.warning("prefill CUDA graph capture failed (%s); prompts prefill eager", exc)
            self.pgraphs.clear()
            self.lora_pgraphs.clear()
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

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the prefill paths once per Triton specialisation class (a batch or token count
        of 1, a multiple of 16, anything else; with and without a cached prefix), so no kernel
        is compiled while serving. Everything reads and writes the scratch page 0 only."""
        dev, ps = self.device, self.ps
        # and two steps of the size busy traffic brings (kernels pick tiles by token count;
        # the H200 compiled for ~0.9 s at its first 896-token step without them)
        shapes = [(n, L) for n in (1, 3, 16, 17) for L in (1, 5, 16)] + [(7, 128), (9, 113)]
        for n_seqs, L in shapes:
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
                # with LoRA, its kernels too (rows of slot 0: launched, nothing added)
                for rows in (None, torch.zeros(T, dtype=torch.int32, device=dev)) if self.lora else (None,):
                    hidden = self._forward(torch.zeros(T, dtype=torch.int64, device=dev), pos, meta, rows)
                    self.model.logits(hidden[L - 1::L])
        if self.cuda:
            torch.cuda.synchronize(dev)
