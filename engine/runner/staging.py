"""A step's inputs: the pinned staging buffer they are packed into (one host buffer per
ring slot, one device buffer, one non-blocking copy a step) and the typed fields the
runner stages and launches (`StepInputs`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.request import Request
from ..sampling import prompt_logprobs as plp
from ..sampling.grammar_mask import GrammarRows

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
    # one forward a step: the rows of the step's decodes, the last B of the forward
    # (their tokens come from the device's last sampled ids), and the last `decode_tail`
    # rows' context lengths (0: not a decode) and slots (the pad slot: not a decode), for
    # the decode kernel that takes their attention (model.decoder.AttnMeta)
    decode_rows: torch.Tensor | None = None  # int64 [B]
    decode_ctx: torch.Tensor | None = None   # int32 [decode_tail]
    decode_tail_slots: torch.Tensor | None = None  # int64 [decode_tail]


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


