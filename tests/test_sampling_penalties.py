"""The penalties and logit_bias on the device tables, against vLLM's definitions written
out by hand."""

from __future__ import annotations

import torch
from zerod.engine.sampling.penalties import PenaltyTables


def test_penalties_match_vllm_definitions():
    t = PenaltyTables(slots=3, max_model_len=8, device=torch.device("cpu"))
    # slot 1: prompt [2, 3], output [3, 4, 4]; slot 2 has no penalty row in this step
    t.record(torch.tensor([1] * 5), torch.arange(5), torch.tensor([2, 3, 3, 4, 4]))
    t.presence[1], t.frequency[1], t.repetition[1] = 0.5, 0.25, 2.0
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0, 2.0, 1.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = t.apply(logits, rows=torch.tensor([0]), slots=torch.tensor([1]),
                  seq_lens=torch.tensor([5]), prompt_lens=torch.tensor([2]), width=5)
    want = logits[0].clone()
    want[2] = 1.0 / 2.0                            # seen in the prompt: positive / rep
    want[3] = -1.0 * 2.0 - 0.25 * 1 - 0.5          # seen; negative * rep; once in the output
    want[4] = 2.0 / 2.0 - 0.25 * 2 - 0.5           # twice in the output
    assert torch.allclose(out[0], want)
    assert torch.equal(out[1], logits[1])          # rows without penalties are untouched


def test_logit_bias_rows():
    t = PenaltyTables(slots=2, max_model_len=4, device=torch.device("cpu"))
    t.bias_ids[1, :2] = torch.tensor([3, 1])
    t.bias_vals[1, :2] = torch.tensor([5.0, -5.0])
    logits = torch.zeros(2, 5)
    out = t.add_bias(logits, rows=torch.tensor([1]), slots=torch.tensor([1]))
    assert out[1].tolist() == [0.0, -5.0, 0.0, 5.0, 0.0] and out[0].tolist() == [0.0] * 5
