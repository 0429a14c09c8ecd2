"""What crosses from rank 0 to the other tensor-parallel ranks each step, without pickling.

Rank 0 packs a step as it always does (runner/staging.py's Staging / Packer: named fields in one
buffer, copied to the device in one go). Then, per step:

1. a fixed-size int64 header over the host (gloo) group: the packed word count, which
   parts the step has, each forward field's offset and length in the packed buffer, and
   the few host-side values the forward needs (widths, padding, the chunk lengths);
2. the packed buffer itself, one broadcast from rank 0's device staging buffer into the
   worker's (NCCL on CUDA, queued in stream order: no host sync);
3. after rank 0 has sampled, the sampled ids (one broadcast), which every rank writes into
   its `last_tokens` (the next decode's input).

Workers rebuild the forward's views at the header's offsets; they never read a request's
sampling parameters (those words travel in the buffer but nothing on a worker looks at
them). A header of kind STOP ends a worker's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runner.staging import DecodeInputs, PrefillInputs, StepInputs

STOP, STEP = 0, 1
_HAS_UPLOAD, _HAS_PREFILL, _HAS_DECODE = 1, 2, 4

# the forward's fields: (name, part, attribute, element type of the packed view)
FIELDS = (
    ("bt_rows", "upload", "bt_rows", torch.int64),
    ("bt_cols", "upload", "bt_cols", torch.int64),
    ("bt_pages", "upload", "bt_pages", torch.int32),
    ("tokens", "prefill", "tokens", torch.int64),
    ("positions", "prefill", "positions", torch.int64),
    ("slot_mapping", "prefill", "slot_mapping", torch.int64),
    ("cu_seqlens", "prefill", "cu_seqlens", torch.int32),
    ("context_lens", "prefill", "context_lens", torch.int32),
    ("slots", "prefill", "slots", torch.int64),
    ("sample_idx", "prefill", "sample_idx", torch.int64),
    ("sample_slots", "prefill", "sample_slots", torch.int64),
    ("d_slots", "decode", "slots", torch.int64),
    ("d_positions", "decode", "positions", torch.int64),
)
# header words: kind, words, parts, prefill width, no_prefix, padded, decode width, chunks;
# then (offset, length) per field; then the chunk lengths
_KIND, _WORDS, _PARTS, _P_WIDTH, _NO_PREFIX, _PADDED, _D_WIDTH, _CHUNKS = range(8)
_FIELD0 = 8
_SEQLENS0 = _FIELD0 + 2 * len(FIELDS)


def header_words(max_num_seqs: int) -> int:
    return _SEQLENS0 + max_num_seqs


@dataclass
class WorkerStep:
    """A worker's view of one step: only what the forward and last_tokens need."""
    block_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # rows, cols, pages
    prefill: PrefillInputs | None     # sampling fields empty
    decode: DecodeInputs | None       # sampling fields empty

    @property
    def sampled(self) -> int:
        """Ids rank 0 sends after sampling: the prefill's completed prompts, then the decodes."""
        s = self.prefill.sample_idx.numel() if self.prefill is not None else 0
        return s + (self.decode.slots.numel() if self.decode is not None else 0)


class StepChannel:
    """Both ends: rank 0 sends (send_step, send_tokens, send_stop), workers receive
    (recv_step, recv_tokens) in the same order."""

    def __init__(self, tp, staging, max_num_seqs: int):
        self.tp = tp
        self.dev = staging.dev               # this rank's device staging buffer (int64 words)
        self.views = {torch.int64: staging.dev, torch.int32: staging.dev.view(torch.int32)}
        self.header = torch.zeros(header_words(max_num_seqs), dtype=torch.int64)
        self._h = self.header.numpy()      # filled through numpy: ~0.1 us a word, not a torch op

    # ------------------------------------------------------------------ rank 0
    def send_step(self, x: StepInputs) -> None:
        h = self._h
        h[:] = 0
        p, d = x.prefill, x.decode
        h[_KIND], h[_WORDS] = STEP, x.words
        h[_PARTS] = ((_HAS_UPLOAD if x.upload is not None else 0) | (_HAS_PREFILL if p is not None else 0)
                     | (_HAS_DECODE if d is not None else 0))
        if p is not None:
            h[_P_WIDTH], h[_NO_PREFIX], h[_PADDED], h[_CHUNKS] = p.width, p.no_prefix, p.padded, len(p.seqlens)
            h[_SEQLENS0:_SEQLENS0 + len(p.seqlens)] = p.seqlens
        if d is not None:
            h[_D_WIDTH] = d.width
        parts = dict(upload=x.upload, prefill=p, decode=d)
        for i, (_, part, attr, _) in enumerate(FIELDS):
            obj = parts[part]
            if obj is not None:
                t = getattr(obj, attr)
                h[_FIELD0 + 2 * i] = t.storage_offset()
                h[_FIELD0 + 2 * i + 1] = t.numel()
        self.tp.host_broadcast(self.header)
        if x.words:
            self.tp.broadcast(self.dev[:x.words])

    def send_tokens(self, prefill_tok: torch.Tensor | None, decode_tok: torch.Tensor | None) -> None:
        toks = [t for t in (prefill_tok, decode_tok) if t is not None]
        if toks:
            self.tp.broadcast(torch.cat(toks) if len(toks) > 1 else toks[0].contiguous())

    def send_stop(self) -> None:
        self._h[:] = 0
        self._h[_KIND] = STOP
        self.tp.host_broadcast(self.header)

    # ------------------------------------------------------------------ workers
    def recv_step(self) -> WorkerStep | None:
        """The next step (blocks until rank 0 sends it); None: stop."""
        h = self.header
        self.tp.host_broadcast(h)
        hv = h.tolist()
        if hv[_KIND] == STOP:
            return None
        words, parts = hv[_WORDS], hv[_PARTS]
        if words:
            self.tp.broadcast(self.dev[:words])
        f = {}
        for i, (name, _, _, dtype) in enumerate(FIELDS):
            o, n = hv[_FIELD0 + 2 * i], hv[_FIELD0 + 2 * i + 1]
            f[name] = self.views[dtype][o:o + n]
        upload = (f["bt_rows"], f["bt_cols"], f["bt_pages"]) if parts & _HAS_UPLOAD else None
        prefill = decode = None
        if parts & _HAS_PREFILL:
            prefill = PrefillInputs(
                tokens=f["tokens"], positions=f["positions"], slot_mapping=f["slot_mapping"],
                cu_seqlens=f["cu_seqlens"], context_lens=f["context_lens"], slots=f["slots"],
                sample_idx=f["sample_idx"], sample_slots=f["sample_slots"], sample_reqs=[],
                logit_rules=None, logprob_rows=None, tok_slots=None, n_real=0,
                seqlens=hv[_SEQLENS0:_SEQLENS0 + hv[_CHUNKS]], width=hv[_P_WIDTH],
                no_prefix=bool(hv[_NO_PREFIX]), padded=hv[_PADDED])
        if parts & _HAS_DECODE:
            decode = DecodeInputs(slots=f["d_slots"], positions=f["d_positions"], reqs=[],
                                  logit_rules=None, logprob_rows=None, width=hv[_D_WIDTH])
        return WorkerStep(upload, prefill, decode)

    def recv_tokens(self, n: int) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.int64, device=self.dev.device)
        return self.tp.broadcast(out)
