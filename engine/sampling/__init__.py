"""Logits to tokens: sampling, penalties, logprobs, structured-output masks."""
