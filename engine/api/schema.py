"""Declarative JSON fields: one definition validates a decoded request body AND emits its
JSON Schema (the request bodies of /openapi.json), so the published schema cannot drift
from what the server accepts.

Types: `Int`, `Num`, `Str`, `Bool`, `Array`, `Obj` (of `Field`s), `AnyOf`. `check(value,
path)` returns the value (an integral float becomes an int, as JSON Schema counts it an
integer) or raises `Invalid` naming the path (`messages[0].role`), which protocol.py turns
into OpenAI's 400. `schema()` is the JSON Schema 2020-12 (OpenAPI 3.1) of the same rules.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class Invalid(ValueError):
    """A value that breaks its field's rules; `param` is the path of the field."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _show(v: Any) -> str:
    return f"{_json_type(v)}: {v!r:.50}"


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object" if isinstance(v, dict) else type(v).__name__


class Type:
    """A JSON value's rules."""

    def check(self, v: Any, path: str) -> Any:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def matches_kind(self, v: Any) -> bool:
        """Whether `v` is of this type's JSON kind (how `AnyOf` picks an alternative)."""
        raise NotImplementedError


def _bounds_schema(s: dict, lo: Any, hi: Any, lo_open: bool = False) -> dict:
    if lo is not None:
        s["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


@dataclass(frozen=True)
class Int(Type):
    lo: int | None = None
    hi: int | None = None
    hi_why: str = ""  # said after the bound: "(the vocabulary size is 32000)"

    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def check(self, v: Any, path: str) -> int:
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise Invalid(f"'{path}' must be an integer, got {_show(v)}", path)
        if self.lo is not None and v < self.lo:
            raise Invalid(f"'{path}' must be >= {self.lo}, got {v}", path)
        if self.hi is not None and v > self.hi:
            why = f" {self.hi_why}" if self.hi_why else ""
            raise Invalid(f"'{path}' must be <= {self.hi}{why}, got {v}", path)
        return v

    def schema(self) -> dict[str, Any]:
        return _bounds_schema({"type": "integer"}, self.lo, self.hi)


@dataclass(frozen=True)
class Num(Type):
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def check(self, v: Any, path: str) -> float:
        if not self.matches_kind(v) or not math.isfinite(v):
            raise Invalid(f"'{path}' must be a finite number, got {_show(v)}", path)
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            raise Invalid(f"'{path}' must be {'>' if self.lo_open else '>='} {self.lo}, "
                          f"got {v}", path)
        if self.hi is not None and v > self.hi:
            raise Invalid(f"'{path}' must be <= {self.hi}, got {v}", path)
        return float(v)

    def schema(self) -> dict[str, Any]:
        return _bounds_schema({"type": "number"}, self.lo, self.hi, self.lo_open)


@dataclass(frozen=True)
class Str(Type):
    min_len: int = 0
    max_len: int | None = None
    enum: tuple[str, ...] | None = None

    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, str)

    def check(self, v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise Invalid(f"'{path}' must be a string, got {_show(v)}", path)
        if self.enum is not None and v not in self.enum:
            raise Invalid(f"'{path}' must be one of {list(self.enum)}, got {v!r:.40}", path)
        if len(v) < self.min_len:
            raise Invalid(f"'{path}' must not be empty" if self.min_len == 1 else
                          f"'{path}' must be at least {self.min_len} characters", path)
        if self.max_len is not None and len(v) > self.max_len:
            raise Invalid(f"'{path}' must be at most {self.max_len} characters, got "
                          f"{len(v)}", path)
        return v

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string"}
        if self.enum is not None:
            s["enum"] = list(self.enum)
        if self.min_len:
            s["minLength"] = self.min_len
        if self.max_len is not None:
            s["maxLength"] = self.max_len
        return s


@dataclass(frozen=True)
class Bool(Type):
    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, bool)

    def check(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            raise Invalid(f"'{path}' must be a boolean, got {_show(v)}", path)
        return v

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


_SCALARS = (Int, Num, Str, Bool)


@dataclass(frozen=True)
class Array(Type):
    """A list. Errors in scalar items name the list itself as `param` (the index is in the
    message); errors inside object or list items name the item (`messages[2].role`).
    Over `max_items`, `over_code` / `over_why` replace the generic error (e.g. a prompt
    batch is `unsupported`, not malformed)."""

    item: Type
    min_items: int = 0
    max_items: int | None = None
    over_code: str | None = None
    over_why: str = ""

    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, list) and (not v or self.item.matches_kind(v[0]))

    def check(self, v: Any, path: str) -> list:
        if not isinstance(v, list):
            raise Invalid(f"'{path}' must be an array, got {_show(v)}", path)
        if len(v) < self.min_items:
            raise Invalid(f"'{path}' must not be empty" if self.min_items == 1 else
                          f"'{path}' must hold at least {self.min_items} items", path)
        if self.max_items is not None and len(v) > self.max_items:
            raise Invalid(self.over_why.format(path=path, n=len(v)) if self.over_why else
                          f"'{path}' must hold at most {self.max_items} items, got {len(v)}",
                          path, self.over_code)
        item = self.item
        if type(item) is Int and _plain_ints_within(v, item.lo, item.hi):
            return v  # the common token-id list: C-speed checks, no per-item call
        scalar = isinstance(item, _SCALARS)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item.check(x, f"{path}[{i}]"))
            except Invalid as exc:
                if scalar:
                    exc.param = path
                raise
        return out

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "array", "items": self.item.schema()}
        if self.min_items:
            s["minItems"] = self.min_items
        if self.max_items is not None:
            s["maxItems"] = self.max_items
        return s


def _plain_ints_within(v: list, lo: int | None, hi: int | None) -> bool:
    if not v or not all(type(x) is int for x in v):
        return False
    return (lo is None or min(v) >= lo) and (hi is None or max(v) <= hi)


@dataclass(frozen=True)
class Field:
    """One member of an object.

    `null` counts as absent unless `null_ok` (then it is kept as None: `max_tokens: null`
    means "what the context leaves"). `only`: the single value this server supports;
    any other (valid) value is refused with code `unsupported` and `only_why`.
    """

    name: str
    type: Type
    required: bool = False
    null_ok: bool = False
    only: Any = None
    only_why: str = ""
    doc: str = ""
    refused: bool = False  # any value (but null) is refused with `only_why`

    def check(self, v: Any, path: str) -> Any:
        if self.refused:
            raise Invalid(f"'{path}' is not supported by this server: {self.only_why}", path,
                          "unsupported")
        v = self.type.check(v, path)
        if self.only is not None and v != self.only:
            raise Invalid(f"'{path}' is not supported by this server: {self.only_why}", path,
                          "unsupported")
        return v

    def schema(self) -> dict[str, Any]:
        if self.refused:
            return {"type": "null", "description": f"{self.doc} Refused (code `unsupported`) "
                    f"unless null: {self.only_why}.".strip()}
        # a field with one supported value publishes that value: generated clients and
        # fuzzers then send what is served; other values are documented as refused
        s = {"const": self.only} if self.only is not None else self.type.schema()
        if not self.required or self.null_ok:  # null is accepted (as absent or as itself)
            s = {"anyOf": [s, {"type": "null"}]}
        doc = self.doc
        if self.only is not None:
            doc = (f"{doc} Refused (code `unsupported`) unless {json.dumps(self.only)}: "
                   f"{self.only_why}.").strip()
        if doc:
            s["description"] = doc
        return s


@dataclass(frozen=True)
class Obj(Type):
    """A JSON object of declared fields; a member that is not declared is refused (a
    client that sends a field this server does not know must not get an answer that
    silently ignored it), unless `closed` is False (then ignored). With `values`, every
    member is checked against it (a map). `when` holds (field, other, value): `field` is
    allowed only when `other` is `value`."""

    fields: tuple[Field, ...] = ()
    values: Type | None = None
    when: tuple[tuple[str, str, Any], ...] = ()
    closed: bool = True

    def matches_kind(self, v: Any) -> bool:
        return isinstance(v, dict)

    def check(self, v: Any, path: str = "") -> dict[str, Any]:
        if not isinstance(v, dict):
            raise Invalid(f"'{path}' must be an object, got {_show(v)}" if path else
                          f"the request body must be a JSON object, got {_json_type(v)}",
                          path or None)
        out: dict[str, Any] = {}
        for f in self.fields:
            where = f"{path}.{f.name}" if path else f.name
            x = v.get(f.name)
            if x is None:
                if f.required:
                    raise Invalid(f"'{where}' is required", where)
                out[f.name] = None
                continue
            out[f.name] = f.check(x, where)
        if self.values is not None:
            for k, x in v.items():
                where = f"{path}.{k}" if path else k
                out[k] = self.values.check(x, where)
        elif self.closed:
            for k in v:
                if k not in out:
                    where = f"{path}.{k}" if path else k
                    raise Invalid(f"'{where}' is not a field this server knows (unrecognized "
                                  f"request argument)", where, "unknown_field")
        for name, other, value in self.when:
            if out[name] is not None and out[other] != value:
                where = f"{path}.{name}" if path else name
                raise Invalid(f"'{where}' is only allowed when '{other}' is "
                              f"{json.dumps(value)}", where)
        return out

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "object"}
        if self.fields:
            s["properties"] = {f.name: f.schema() for f in self.fields}
        req = [f.name for f in self.fields if f.required]
        if req:
            s["required"] = req
        if self.values is not None:
            s["additionalProperties"] = self.values.schema()
        elif self.closed and self.fields:
            s["additionalProperties"] = False
        if self.when:
            s["allOf"] = [{"if": {"properties": {name: {"not": {"type": "null"}}},
                                  "required": [name]},
                           "then": {"properties": {other: {"const": value}},
                                    "required": [other]}}
                          for name, other, value in self.when]
        return s


@dataclass(frozen=True)
class AnyOf(Type):
    """One of several types, picked by the value's JSON kind (the first alternative of
    that kind checks it, so its error is the one reported)."""

    alts: tuple[Type, ...]
    what: str  # "a string or a list of strings"

    def matches_kind(self, v: Any) -> bool:
        return any(a.matches_kind(v) for a in self.alts)

    def check(self, v: Any, path: str) -> Any:
        for a in self.alts:
            if a.matches_kind(v):
                return a.check(v, path)
        raise Invalid(f"'{path}' must be {self.what}, got {_json_type(v)}", path)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [a.schema() for a in self.alts]}
