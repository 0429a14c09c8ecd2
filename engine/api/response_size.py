"""What one request may make the server produce, and how a large answer is encoded.

A non-streamed answer is built whole in memory, so its output tokens and logprob entries
are bounded per
request before any work is queued (a 400 naming the bound). The answer is then encoded
off the event loop, in slices: one `json.dumps` call holds the GIL for its whole run, so a
list of many entries is encoded a slice at a time, and the event loop (`/health`, other
streams) runs between slices.
"""

from __future__ import annotations

import json
from typing import Any

from .protocol import CompletionRequest, bad

# Logprob entries (each token's logprob plus its alternatives, prompt and output) one
# non-streamed answer may hold, over all its choices; about 40-100 bytes of JSON each.
MAX_RESPONSE_LOGPROB_ENTRIES = 1 << 21
# Output tokens one non-streamed answer may hold over all its choices (its text, a few
# bytes each): a whole 128k context for 32 choices.
MAX_RESPONSE_TOKENS = 1 << 22
# Items of a list encoded by one json.dumps call: a slice of at most a few hundred KB,
# a millisecond or so of held GIL.
ENCODE_SLICE = 512


def check_response_size(req: CompletionRequest, prompt_lens: list[int],
                        max_tokens: list[int]) -> None:
    """Refuse a non-streamed request whose answer could hold more than
    MAX_RESPONSE_LOGPROB_ENTRIES logprob entries (prompt_lens[i], max_tokens[i]: prompt i's
    length and settled max_tokens; each prompt makes req.n choices)."""
    if req.stream:
        return   # a stream sends each token as it comes; nothing accumulates
    tokens = sum(max_tokens) * req.n
    if tokens > MAX_RESPONSE_TOKENS:
        raise bad(f"this request could make an answer of {tokens} output tokens "
                  f"({len(prompt_lens)} prompt(s) x n={req.n} x max_tokens), over this server's "
                  f"cap of {MAX_RESPONSE_TOKENS} per answer (MAX_RESPONSE_TOKENS); set a "
                  "smaller max_tokens or fewer choices, or stream", "max_tokens",
                  "response_too_large")
    entries = 0
    if req.prompt_logprobs is not None:
        entries += sum(prompt_lens) * req.n * (1 + req.prompt_logprobs)
    if req.logprobs is not None:
        entries += sum(max_tokens) * req.n * (1 + req.logprobs)
    if entries <= MAX_RESPONSE_LOGPROB_ENTRIES:
        return
    raise bad(f"this request could make an answer of {entries} logprob entries "
              f"({len(prompt_lens)} prompt(s) x n={req.n}, prompt and output tokens x "
              "(1 + alternatives)), over this server's cap of "
              f"{MAX_RESPONSE_LOGPROB_ENTRIES} per answer (MAX_RESPONSE_LOGPROB_ENTRIES); "
              "set a smaller max_tokens, fewer choices or fewer alternatives, or stream",
              "logprobs" if req.logprobs is not None else "prompt_logprobs",
              "response_too_large")


def encode_sliced(obj: Any) -> bytes:
    """json.dumps(obj, ensure_ascii=False).encode(), with long lists encoded a slice at a
    time so no single call holds the GIL for long."""
    parts: list[str] = []
    _encode(obj, parts)
    return "".join(parts).encode()


def _encode(obj: Any, parts: list[str]) -> None:
    if isinstance(obj, dict) and obj:
        parts.append("{")
        for n, (k, v) in enumerate(obj.items()):
            if n:
                parts.append(", ")
            parts.append(json.dumps(str(k), ensure_ascii=False))
            parts.append(": ")
            _encode(v, parts)
        parts.append("}")
    elif isinstance(obj, list) and len(obj) > ENCODE_SLICE:
        parts.append("[")
        for start in range(0, len(obj), ENCODE_SLICE):
            if start:
                parts.append(", ")
            parts.append(json.dumps(obj[start:start + ENCODE_SLICE], ensure_ascii=False)[1:-1])
        parts.append("]")
    elif isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        # a short list of containers (the choices): each may hold long lists
        parts.append("[")
        for n, x in enumerate(obj):
            if n:
                parts.append(", ")
            _encode(x, parts)
        parts.append("]")
    else:
        parts.append(json.dumps(obj, ensure_ascii=False))
