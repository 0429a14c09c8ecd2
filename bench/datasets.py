"""Prompts from a dataset file, as `vllm bench serve --dataset-name sharegpt` reads them.

ShareGPT's JSON: a list of {"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}; each entry gives its first human turn as the
prompt and the reply after it for the output length. zerod bench has no tokenizer (it
measures any server from outside), so lengths are estimated at 4 characters a token
(the server's usage says the real counts); entries are kept as vLLM keeps them: prompt
and reply of at least 4 tokens, prompt at most 1024, both at most 2048.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CHARS_PER_TOKEN = 4
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048


class DatasetError(Exception):
    """The dataset file cannot be used; the message says why."""


@dataclass(frozen=True)
class Sample:
    prompt: str
    output_len: int   # tokens to ask for (max_tokens)


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def load_sharegpt(path: str, num: int, seed: int, output_len: int | None = None) -> list[Sample]:
    """`num` samples drawn (seeded) from the file; `output_len` overrides each reply's."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise DatasetError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: ShareGPT's layout is a JSON list of "
                           '{"conversations": [...]} entries')
    pairs: list[Sample] = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, answer = first.get("value"), reply.get("value")
        if not (isinstance(prompt, str) and isinstance(answer, str)):
            continue
        p = estimate_tokens(prompt)
        o = output_len or estimate_tokens(answer)
        if p < MIN_TOKENS or o < MIN_TOKENS and output_len is None:
            continue
        if p > MAX_PROMPT_TOKENS or p + o > MAX_TOTAL_TOKENS:
            continue
        pairs.append(Sample(prompt, o))
    if not pairs:
        raise DatasetError(f"{path}: no conversation with a prompt and a reply of "
                           f"{MIN_TOKENS}..{MAX_PROMPT_TOKENS} tokens")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    # fewer entries than asked: cycle through them, as a benchmark wants its count
    return [pairs[i % len(pairs)] for i in range(num)]
