"""Small pure formatters shared by the widgets (no Textual here)."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

NA = "–"


def num(value: Any) -> float | None:
    """A number from the API, or None for null / anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def gib(value: Any) -> str:
    v = num(value)
    return NA if v is None else f"{v / 2**30:.1f}"


def bytes_h(value: Any) -> str:
    v = num(value)
    if v is None:
        return NA
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{int(v)} B"


def ms(seconds: Any) -> str:
    v = num(seconds)
    if v is None:
        return NA
    v *= 1000
    return f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def pct(ratio: Any) -> str:
    v = num(ratio)
    return NA if v is None else f"{v * 100:.0f}%"


def duration(seconds: Any) -> str:
    v = num(seconds)
    if v is None:
        return NA
    s = int(max(0, v))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def ago(ts: Any, now: float) -> str:
    v = num(ts)
    return NA if v is None else f"{duration(now - v)} ago"


def utc(ts: Any) -> str:
    v = num(ts)
    if v is None:
        return NA
    return _dt.datetime.fromtimestamp(v, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def rate(value: Any) -> str:
    v = num(value)
    if v is None:
        return NA
    return f"{v / 1000:.1f}k" if v >= 10000 else f"{v:.0f}"


def series(value: Any) -> list[float]:
    """A history array as floats; nulls dropped, anything else an empty list."""
    if not isinstance(value, list):
        return []
    return [float(x) for x in value if num(x) is not None]


def evidence_text(evidence: Any) -> str:
    """Doctor evidence in whatever shape: a list of {value, source}, a dict, a string."""
    if evidence is None:
        return ""
    if isinstance(evidence, str):
        return evidence
    if isinstance(evidence, dict):
        if "value" in evidence and set(evidence) <= {"value", "source", "name", "error"}:
            value = evidence["value"]
            if isinstance(value, (dict, list)):
                value = json.dumps(value, separators=(",", ":"))
            text = f"{evidence['name']}={value}" if evidence.get("name") else f"{value}"
            if evidence.get("error"):
                text += f" [{evidence['error']}]"
            src = evidence.get("source")
            return text + (f" ({src})" if src else "")
        return ", ".join(f"{k}={v}" for k, v in evidence.items())
    if isinstance(evidence, list):
        return "; ".join(evidence_text(e) for e in evidence)
    return str(evidence)
