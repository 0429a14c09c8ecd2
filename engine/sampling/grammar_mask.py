"""The device side of structured outputs (structured.py): a step's masks computed on the
CPU while the GPU runs the step's forward, shipped in one copy and applied to the logits
with tensor ops (no host sync in the launch; the one wait, for the previous step's ids, is
the mask's own dependency)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .structured import advance_all, fill_masks

_BITS: dict[str, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where the rows' bitmasks disallow: masks int32 [G, W], bit v
    of word v//32 set = allowed, every id from 32 W on disallowed; rows int64 [G] are row
    indices. Tensor ops only: no host sync."""
    key = str(logits.device)
    bits = _BITS.get(key)
    if bits is None:
        bits = _BITS[key] = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8,
                                         device=logits.device)
    V = logits.shape[1]
    n = min(V, 32 * masks.shape[1])
    # read as bytes (little-endian, as xgrammar writes them: token 8 j + k is bit k of
    # byte j): a quarter of the memory traffic of unpacking int32 words
    blocked = (masks.view(torch.uint8).unsqueeze(-1) & bits).eq(0).view(masks.shape[0], -1)
    picked = logits.index_select(0, rows)
    picked[:, :n].masked_fill_(blocked[:, :n], float("-inf"))
    picked[:, n:] = float("-inf")
    return logits.index_copy(0, rows, picked)


@dataclass
class GrammarRows:
    """The masked rows of one sampling call: row indices int64 [G] and masks int32 [G, W]."""
    rows: torch.Tensor
    masks: torch.Tensor


class MaskStaging:
    """Pinned host mask rows per ring slot and one device buffer (allocated on first use:
    a server that never sees a grammar pays nothing), and the matchers' catching up.

    A masked step runs in three parts (model_runner.launch): `plan` at staging picks the
    sampled rows that have a grammar; after the step's forwards are queued, `fill` waits
    for the previous masked step's ids (its event), advances those rows' matchers, fills
    this step's mask rows into the ring slot's pinned rows and queues their copy — the GPU
    runs the forwards meanwhile; after the step's ids are queued for the ring, `launched`
    records an event and the rows whose tokens the next `fill` takes. Every masked row is
    in every step (scheduler.py), so the next masked step takes them; rows of requests
    that ended meanwhile are skipped. A redone step (engine.py) is safe: `fill` consumes
    the pending rows once, and a step that raised recorded none."""

    def __init__(self, depth: int, rows: int, device: torch.device) -> None:
        self.depth, self.max_rows, self.device = depth, rows, device
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self._pending: list[tuple[int, Any]] = []   # (ring row, request) whose token is due
        self._pending_ids: torch.Tensor | None = None   # the ring slot's host ids
        self._pending_event: Any = None
        self.broken: list[Any] = []   # requests whose token the grammar refused (a bug)

    def plan(self, groups: list[list[Any]], pack_rows) -> tuple[list[GrammarRows | None], list[Any]]:
        """For each group of sampled requests (in sampling order), the GrammarRows of those
        with a grammar (None: none has), and all of them in mask-row order.
        pack_rows(list[int]) ships row indices with the step's inputs."""
        picked = [[i for i, r in enumerate(reqs) if r.grammar is not None] for reqs in groups]
        masked = [reqs[i] for reqs, idx in zip(groups, picked) for i in idx]
        if masked and self.host is None:   # every state's rows are its compiler's width
            words = masked[0].grammar.words
            self.host = torch.zeros(self.depth, self.max_rows, words, dtype=torch.int32,
                                    pin_memory=self.device.type == "cuda")
            self.dev = torch.zeros(self.max_rows, words, dtype=torch.int32, device=self.device)
        out: list[GrammarRows | None] = []
        n = 0
        for idx in picked:
            out.append(GrammarRows(pack_rows(idx), self.dev[n:n + len(idx)]) if idx else None)
            n += len(idx)
        return out, masked

    def fill(self, ring_idx: int, masked: list[Any]) -> None:
        """The masks of `masked` (plan's order) into the device rows: after catching up."""
        self.catch_up()
        n = len(masked)
        if not n:
            return
        host = self.host[ring_idx]
        fill_masks([r.grammar for r in masked], host, list(range(n)))
        self.dev[:n].copy_(host[:n], non_blocking=True)

    def launched(self, ids_host: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
        """The step's sampled ids are queued into ids_host (its ring slot): rows (ring row,
        request) take them in the next fill."""
        self._pending, self._pending_ids = rows, ids_host
        self._pending_event = None
        if self.device.type == "cuda":
            self._pending_event = torch.cuda.Event(blocking=True)
            self._pending_event.record()

    def catch_up(self) -> None:
        """Advance the matchers by the last masked step's tokens (waiting for its ids)."""
        live = [(i, r) for i, r in self._pending if not r.released and not r.grammar.terminated]
        if live:
            if self._pending_event is not None:
                self._pending_event.synchronize()
            ids = self._pending_ids.tolist()
            toks = [ids[i] for i, _ in live]
            for (_, r), ok in zip(live, advance_all([r.grammar for _, r in live], toks)):
                if not ok:
                    self.broken.append(r)
        self._pending, self._pending_ids, self._pending_event = [], None, None
