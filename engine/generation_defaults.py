"""`--generation-config auto|vllm|DIR`: the sampling defaults of requests that leave them unset.

As vLLM: `auto` reads the model directory's generation_config.json, a directory
reads its own, `vllm` uses none; `--override-generation-config` lays a JSON
object over them. Of the file, the fields below count; `max_new_tokens` becomes
the default max_tokens. Each value is checked against the request field's range
(protocol.py's tables check the same request field), so a bad file fails at start.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's key -> the request field it is the default of, and its range
FIELDS: dict[str, tuple[str, type, float, float]] = {
    "temperature": ("temperature", float, 0.0, 2.0),
    "top_p": ("top_p", float, 1e-9, 1.0),
    "top_k": ("top_k", int, -1, 1 << 31),
    "min_p": ("min_p", float, 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", float, 1e-9, 2.0),
    "max_new_tokens": ("max_tokens", int, 1, 1 << 31),
}


def generation_defaults(mode: str, model: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """{request field: default} for --generation-config MODE and the overrides;
    ValueError with a one-line reason when a value cannot be a default."""
    found: dict[str, Any] = {}
    if mode == "auto":
        path = None if model == "demo" else Path(model) / GENERATION_CONFIG_FILE
        source = _read(path) if path is not None and path.is_file() else {}
    elif mode == "vllm":
        source = {}
    else:
        d = Path(mode).expanduser()
        if not (d / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"{mode} is not auto, vllm nor a directory holding "
                             f"{GENERATION_CONFIG_FILE}")
        source = _read(d / GENERATION_CONFIG_FILE)
    layers = ((source, GENERATION_CONFIG_FILE), (overrides or {}, "--override-generation-config"))
    for layer, where in layers:
        for key, value in layer.items():
            if key not in FIELDS:
                if layer is overrides:
                    raise ValueError(f"{where}: {key!r} is not one of {', '.join(FIELDS)}")
                continue  # the file's other keys (eos_token_id, do_sample ...) are not defaults
            name, kind, lo, hi = FIELDS[key]
            found[name] = _checked(where, key, value, kind, lo, hi)
    return found


def describe_defaults(defaults: dict[str, Any]) -> str:
    """The start log's line: which defaults requests get."""
    if not defaults:
        return "none (each field's own default)"
    return ", ".join(f"{k}={v}" for k, v in defaults.items())


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _checked(where: str, key: str, value: Any, kind: type, lo: float, hi: float) -> Any:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (kind is float or float(value).is_integer()))
    if not ok or not lo <= value <= hi:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{where}: {key} = {value!r} must be {what} in [{lo:g}, {hi:g}]")
    return kind(value)


def apply_defaults(req: Any, body: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Set each default on a parsed request whose body left that field out (the
    max_tokens default is the server's default_max_tokens: see split_max_tokens)."""
    for name, value in defaults.items():
        if name in body or name == "max_tokens":
            continue
        setattr(req, name, 0 if name == "top_k" and value == -1 else value)


def split_max_tokens(defaults: dict[str, Any], default_max_tokens: int | None
                     ) -> tuple[dict[str, Any], int | None]:
    """(the per-field defaults, the cap of requests without max_tokens): max_new_tokens
    caps what the context leaves, as --default-max-tokens does (the smaller wins)."""
    rest = {k: v for k, v in defaults.items() if k != "max_tokens"}
    caps = [c for c in (defaults.get("max_tokens"), default_max_tokens) if c is not None]
    return rest, (min(caps) if caps else None)
