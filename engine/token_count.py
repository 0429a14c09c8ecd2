"""A token count as vLLM's command line reads one: 32768, 32k (x1000), 32K (x1024), 1M,
1m, 25.6k; `auto` or -1 (where allowed) for "the model's own" (None). Pure Python: the
flag table (engine/flags.py) and doctor's reading of `[engine]` both use it."""

from __future__ import annotations

import re

_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_MULT = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "K": 1024, "M": 1024 ** 2,
         "G": 1024 ** 3}


def parse_token_count(value: object, auto: bool = False) -> int | None:
    """The count, or None for auto; ValueError saying what is accepted otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if auto and value == -1 else value
    text = str(value).strip()
    if auto and text.lower() in ("auto", "-1"):
        return None
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"{value!r} is not a token count (e.g. 32768, 32k, 32K, 1M"
                         + (", auto" if auto else "") + ")")
    n = float(m.group(1)) * _MULT[m.group(2)]
    if not n.is_integer():
        raise ValueError(f"{value!r} is not a whole number of tokens")
    return int(n)
