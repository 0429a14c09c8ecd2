"""Presence, frequency and repetition penalties and logit_bias, on the device.

The token history: one int32 row per slot of max_model_len entries, the prompt then the
output, written as the tokens are (prompt tokens by their prefill step, each sampled token
by the step that sampled it), so nothing is read back to the host. Memory: (max_num_seqs
+ 1) x max_model_len x 4 bytes, 4 bytes per token of context where the KV cache spends
tens of KiB; a [slots, vocab] count table would be vocab / max_model_len times that.

A step's rows that use a penalty (a host-known list, staged with the step's inputs) get
their counts built by one scatter over the history up to the longest of them (vLLM's
bins, built per step from the history instead of kept), then the penalties in vLLM's
order: repetition (over prompt and output; a positive logit is divided, a negative one
multiplied), then frequency and presence (over the output). logit_bias: up to
MAX_LOGIT_BIAS (id, value) pairs per slot, added to the rows that have one.
"""

from __future__ import annotations

import torch

MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries


def uses_penalty(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class PenaltyTables:
    """Per-slot device tables: the token history, the three penalties, logit_bias."""

    def __init__(self, slots: int, max_model_len: int, device: torch.device):
        self.hist = torch.zeros(slots, max_model_len, dtype=torch.int32, device=device)
        self.presence = torch.zeros(slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(slots, dtype=torch.float32, device=device)
        self.repetition = torch.ones(slots, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_vals = torch.zeros(slots, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)

    def record(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Tokens at their positions of their slots' history."""
        self.hist.index_put_((slots, positions), tokens.to(torch.int32))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
              seq_lens: torch.Tensor, prompt_lens: torch.Tensor, width: int) -> torch.Tensor:
        """Penalised logits of `rows` (of logits [B, V]); slots, seq_lens (tokens in the
        history), prompt_lens are the rows' own. width: host-known max of seq_lens."""
        x = logits.index_select(0, rows)
        P, V = x.shape
        toks = self.hist.index_select(0, slots)[:, :width].long()
        at = torch.arange(width, device=x.device).unsqueeze(0)
        valid = at < seq_lens.unsqueeze(1)
        out = (valid & (at >= prompt_lens.unsqueeze(1))).float()
        counts = torch.zeros(P, V, device=x.device).scatter_add_(1, toks, out)
        seen = torch.zeros(P, V, device=x.device).scatter_add_(1, toks, valid.float()) > 0
        rep = self.repetition.index_select(0, slots).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.frequency.index_select(0, slots).unsqueeze(1) * counts
        x = x - self.presence.index_select(0, slots).unsqueeze(1) * (counts > 0).float()
        return logits.index_copy(0, rows, x)

    def add_bias(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x = logits.index_select(0, rows).scatter_add(
            1, self.bias_ids.index_select(0, slots), self.bias_vals.index_select(0, slots))
        return logits.index_copy(0, rows, x)
