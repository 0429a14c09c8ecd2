"""The per-slot device tables: what a request needs on the device, written once in its
first step (its block-table row, sampling parameters, penalties, adapter slot) and read
by every step after by slot, so a decode step ships only (slot, position) per request.
Row S (the pad slot) stays zero: its block table points at the scratch page 0."""

from __future__ import annotations

import torch

from ..sampling.penalties import PenaltyTables
from .staging import SlotUpload


class SlotTables:
    def __init__(self, max_num_seqs: int, width: int, max_model_len: int, eos_ids: list[int],
                 dev: torch.device):
        S = max_num_seqs
        self.block_table = torch.zeros(S + 1, width, dtype=torch.int32, device=dev)
        self.prompt_len = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.top_k = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.min_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(S + 1, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(S + 1, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(S + 1, dtype=torch.float32, device=dev)
        self.pen = PenaltyTables(S + 1, max_model_len, dev)
        # the next decode input of each slot: its last sampled token, never read back by the host
        self.last_tokens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.lora_slot = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.eos = torch.tensor(eos_ids or [0], dtype=torch.int64, device=dev)

    def write(self, u: SlotUpload) -> None:
        """The tables of the requests new on the device this step."""
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
