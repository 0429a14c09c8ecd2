"""The device side of structured outputs (structured.py): a step's masks shipped in one
copy and applied to the logits with tensor ops (no host sync)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_BITS: dict[str, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where the rows' bitmasks (int32 [G, W], bit v of word v//32
    set = allowed) disallow; rows int64 [G] are row indices. Tensor ops only: no host sync."""
    key = str(logits.device)
    bits = _BITS.get(key)
    if bits is None:
        bits = _BITS[key] = torch.arange(32, dtype=torch.int32, device=logits.device)
    V = logits.shape[1]
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).view(masks.shape[0], -1)[:, :V].bool()
    picked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, picked)


@dataclass
class GrammarRows:
    """The masked rows of one sampling call: row indices int64 [G] and masks int32 [G, W]."""
    rows: torch.Tensor
    masks: torch.Tensor


class MaskStaging:
    """Pinned host mask rows per ring slot and one device buffer (allocated on first use:
    a server that never sees a grammar pays nothing). A step's masked rows are copied to
    the device in one non-blocking copy; the ring slot's host rows are written again only
    once the poller has seen that step finish (as the runner's input staging)."""

    def __init__(self, depth: int, rows: int, vocab_size: int, device: torch.device) -> None:
        self.depth, self.max_rows, self.device = depth, rows, device
        self.words = (vocab_size + 31) // 32
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None

    def stage(self, ring_idx: int, groups: list[list[Any]], pack_rows) -> list[GrammarRows | None]:
        """For each group of sampled requests (in sampling order), the GrammarRows of
        those with a grammar (None: none has). pack_rows(list[int]) ships row indices."""
        if not any(r.grammar is not None for reqs in groups for r in reqs):
            return [None] * len(groups)
        if self.host is None:
            pin = self.device.type == "cuda"
            self.host = torch.zeros(self.depth, self.max_rows, self.words, dtype=torch.int32,
                                    pin_memory=pin)
            self.dev = torch.zeros(self.max_rows, self.words, dtype=torch.int32, device=self.device)
        host = self.host[ring_idx]
        out: list[GrammarRows | None] = []
        n = 0
        for reqs in groups:
            idx = [i for i, r in enumerate(reqs) if r.grammar is not None]
            for j, i in enumerate(idx):
                host[n + j].copy_(reqs[i].grammar.mask[0])
            out.append(GrammarRows(pack_rows(idx), self.dev[n:n + len(idx)]) if idx else None)
            n += len(idx)
        self.dev[:n].copy_(host[:n], non_blocking=True)
        return out
