"""How many characters of raw text one token can stand for, at most, for a given
`tokenizers` pipeline: the bound that lets the server refuse a text prompt that cannot fit
`max_model_len` BEFORE tokenizing it (tokenizing 30 MB takes minutes and gigabytes).

Exact-safe, never an estimate: text of more than `bound * max_model_len` characters is
always more than `max_model_len` tokens. That holds when every character of the text ends
up inside some token, each token covering at most "its longest vocabulary string"
characters. So the bound is the longest vocabulary (or added-token) string, times what the
normalizer can shrink text by; and there is no bound (None) when some stage can drop or
fuse unboundedly many characters: whitespace-splitting pre-tokenizers, stripping
normalizers, an unknown-token that swallows a whole word or a run of unknown characters.

Byte-level vocabularies spell each byte as one character, so their string lengths count
bytes, which are at least the characters they decode to.
"""

from __future__ import annotations

import json
from typing import Any

# Canonical composition merges at most 4 code points into one (the longest canonical
# decomposition, e.g. U+1F82), so NFC/NFKC text has at least a quarter of the characters.
_COMPOSE = 4
_KEEPS_LENGTH = {"Lowercase", "NFD", "NFKD", "Prepend", "ByteLevel"}
_PRE_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def max_chars_per_token(tok: Any) -> int | None:
    """The bound for a `tokenizers.Tokenizer`, or None when its pipeline gives none."""
    spec = json.loads(tok.to_str())
    factor = _normalizer_factor(spec.get("normalizer"))
    if (factor is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
            or not _model_covers_each_char(spec.get("model") or {})):
        return None
    vocab = tok.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1) * factor


def _normalizer_factor(n: dict | None) -> int | None:
    if n is None:
        return 1
    kind = n.get("type")
    if kind in _KEEPS_LENGTH:
        return 1
    if kind in ("NFC", "NFKC"):
        return _COMPOSE
    if kind == "Sequence":
        factor = 1
        for part in n.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a fixed string by a non-empty one (Llama 2: " " -> "▁")
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content") or ""
        if pattern and content:
            return max(1, -(-len(pattern) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex Replace: can drop


def _pre_tokenizer_keeps_text(p: dict | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(x) for x in p.get("pretokenizers", []))
    if kind == "Split":
        return p.get("behavior") != "Removed"
    return kind in _PRE_KEEPS_TEXT  # Whitespace, BertPreTokenizer, ...: drop whitespace


def _model_covers_each_char(m: dict) -> bool:
    kind = m.get("type")
    if kind == "BPE":  # without byte fallback, fused unknowns swallow a run of characters
        return bool(m.get("byte_fallback")) or not (m.get("unk_token") and m.get("fuse_unk"))
    if kind == "Unigram":
        return bool(m.get("byte_fallback"))
    return False  # WordPiece, WordLevel: one unknown token for a whole word
