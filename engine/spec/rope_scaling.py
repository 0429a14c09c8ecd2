"""RoPE scaling as config.json states it (rope_scaling, or transformers >= 5's
rope_parameters), read and checked without torch; model/rope.py computes the tables."""

from __future__ import annotations

from typing import Any

from ..config import EngineError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# The keys each type needs in the scaling dict (besides rope_type).
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor",), "longrope": ("long_factor", "short_factor")}
_ALIASES = {"su": "longrope"}  # early Phi-3 configs
_NEEDS_ORIGINAL_LEN = ("yarn", "llama3", "longrope")


def parse_scaling(raw: dict[str, Any], head_dim: int, max_position_embeddings: int,
                  where: str) -> dict[str, Any] | None:
    """The config's RoPE scaling (rope_scaling, or transformers >= 5's rope_parameters),
    checked and normalised: rope_type set, original_max_position_embeddings filled in
    where the type needs it (Phi-3 keeps it at the top level). None for plain RoPE."""
    rp = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    if scaling is None and rp.get("rope_type", rp.get("type", "default")) != "default":
        scaling = rp
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise EngineError(f"{where}: rope_scaling must be an object, not {scaling!r}")
    rtype = scaling.get("rope_type") or scaling.get("type") or "default"
    rtype = _ALIASES.get(rtype, rtype)
    if rtype not in ROPE_TYPES:
        raise EngineError(f"{where}: rope scaling {rtype!r} is not supported "
                          f"({', '.join(ROPE_TYPES)})")
    if rtype == "default":
        return None
    s = dict(scaling, rope_type=rtype)
    missing = [k for k in _REQUIRED[rtype] if s.get(k) is None]
    if missing:
        raise EngineError(f"{where}: rope scaling {rtype!r} needs {', '.join(missing)}")
    if rtype in _NEEDS_ORIGINAL_LEN:
        orig = raw.get("original_max_position_embeddings") or s.get("original_max_position_embeddings")
        s["original_max_position_embeddings"] = int(orig or max_position_embeddings)
    if rtype == "longrope":
        for k in ("long_factor", "short_factor"):
            if len(s[k]) != head_dim // 2:
                raise EngineError(f"{where}: rope scaling {k} has {len(s[k])} values; "
                                  f"head_dim {head_dim} needs {head_dim // 2}")
    return s
