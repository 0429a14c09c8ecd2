"""The rules a config table is checked against, and the checker.

A section's dataclass is its schema: each field's annotation is the type, its
default the default, and `setting(...)` adds the range, the choices or a check
of its own. `check_table` reads that and answers with the values to build the
dataclass from and the refusals: one line each, naming the key, the value and
what is allowed (`[daemon] health_interval_s = nan: must be a finite number >= 0.1`).

`check_options` does the same for a table whose keys are a click command's
options (`[engine]` and `zerod serve`): the command is the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

import click


@dataclass(frozen=True)
class Rule:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    # An extra check: the value -> None when fine, else what is allowed.
    check: Callable[[Any], str | None] | None = None

    def describe(self) -> str:
        bounds = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le)) if v is not None]
        return " and ".join(bounds)


def setting(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple[str, ...] | None = None,
            check: Callable[[Any], str | None] | None = None) -> Any:
    """A dataclass field with its rule."""
    rule = Rule(ge, gt, le, tuple(choices) if choices else None, check)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"rule": rule})
    return dataclasses.field(default=default, metadata={"rule": rule})


def toml_repr(value: Any) -> str:
    """The value as it would be written in the TOML file (shortened)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = "nan" if math.isnan(value) else ("inf" if value == math.inf else
                                                "-inf" if value == -math.inf else repr(value))
    elif isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(toml_repr(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{k} = {toml_repr(v)}" for k, v in value.items()) + " }"
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refusal(section: str, key: str, value: Any, allowed: str) -> str:
    return f"[{section}] {key} = {toml_repr(value)}: {allowed}"


def unknown_key(section: str, key: str, value: Any, known: list[str]) -> str:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    hint = f"did you mean {near[0]}?" if near else "every key is listed in systemd/zerod.toml.example"
    return refusal(section, key, value, f"unknown key ({hint})")


def check_table(cls: type, section: str, table: dict[str, Any], *,
                scalar_lists: bool = False) -> tuple[dict[str, Any], list[str]]:
    """Check `table` against the dataclass `cls`: (constructor kwargs, refusals).
    `scalar_lists`: a single value where a list belongs counts as a list of one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    refusals: list[str] = []
    for key, value in table.items():
        f = fields.get(key)
        if f is None:
            refusals.append(unknown_key(section, key, value, sorted(fields)))
            continue
        rule = f.metadata.get("rule")
        value, problem = _typed(hints[key], value, scalar_lists)
        if problem is not None and rule is not None and rule.describe():
            problem += " " + rule.describe()  # "must be a finite number >= 0.1"
        elif problem is None:
            problem = _ruled(rule, value)
        if problem is not None:
            refusals.append(refusal(section, key, table[key], problem))
        else:
            values[key] = value
    return values, refusals


def check_options(command: click.Command, section: str, table: dict[str, Any]) -> list[str]:
    """Check `table` against the options of `command` (key = the option's
    name, `max_num_seqs` for --max-num-seqs) with the option's own type."""
    options = {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}
    refusals: list[str] = []
    for key, value in table.items():
        p = options.get(key)
        if p is None:
            refusals.append(unknown_key(section, key, value, sorted(options)))
            continue
        problem = _option_problem(p, value)
        if problem is not None:
            flag = p.opts[0]
            refusals.append(refusal(section, key, value, f"{problem} (zerod {command.name} {flag})"))
    return refusals


# --- the checks ---------------------------------------------------------------

def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _typed(hint: Any, value: Any, scalar_lists: bool) -> tuple[Any, str | None]:
    """(the value in the field's type, None) or (value, what is allowed)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None: TOML has no null, so X
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _typed(inner[0], value, scalar_lists)
    if hint is bool:
        return value, None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value, None if ok else "must be a whole number"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, "must be a number"
        if not math.isfinite(value):
            return value, "must be a finite number"
        return float(value), None
    if hint is str:
        return value, None if isinstance(value, str) else "must be a string (in quotes)"
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1]
        if scalar_lists and not isinstance(value, (list, dict)):
            value = [value]
        if not isinstance(value, list):
            return value, f"must be a list of {_kind(item)}, e.g. [{_example(item)}]"
        out = []
        for v in value:
            v, problem = _typed(item, v, False)
            if problem is not None:
                return value, f"must be a list of {_kind(item)}: {toml_repr(v)} {problem}"
            out.append(v)
        return (tuple(out) if origin is tuple else out), None
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return value, 'must be a table of name = "text", e.g. { name = "value" }'
        return dict(value), None
    raise TypeError(f"no rule for the type {hint}")  # pragma: no cover - a schema bug


def _kind(hint: Any) -> str:
    return {int: "whole numbers", float: "numbers", str: "strings", bool: "true/false"}.get(hint, str(hint))


def _example(hint: Any) -> str:
    return {int: "0, 1", float: "1.0", str: '"a", "b"', bool: "true"}.get(hint, "")


def _ruled(rule: Rule | None, value: Any) -> str | None:
    if rule is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if ((rule.ge is not None and not value >= rule.ge) or (rule.gt is not None and not value > rule.gt)
                or (rule.le is not None and not value <= rule.le)):
            return f"must be {rule.describe()}"
    if rule.choices is not None:
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in items if v not in rule.choices]
        if bad:
            what = "each must be" if isinstance(value, (list, tuple)) else "must be"
            return f"{what} one of {', '.join(rule.choices)}"
    if rule.check is not None:
        return rule.check(value)
    return None


def _option_problem(p: click.Option, value: Any) -> str | None:
    if p.is_flag:
        return None if isinstance(value, bool) else "must be true or false (a flag)"
    if isinstance(value, dict) or isinstance(value, bool):
        return "must be a value, not " + ("a table" if isinstance(value, dict) else "true/false")
    if isinstance(value, list):
        if not p.multiple:
            return "must be a single value, not a list"
        items = value
    else:
        items = [value]
    # a bounded flag of zerod serve (engine/flags.py's Bounded) wraps the number type
    # that reads its word; the type of the value is judged on that one
    base = getattr(p.type, "base", p.type)
    for v in items:
        if isinstance(v, float) and not math.isfinite(v):
            return "must be a finite number"
        if isinstance(base, click.types.IntParamType) and (isinstance(v, bool) or not isinstance(v, int)):
            return "must be a whole number"
        if isinstance(base, click.types.FloatParamType) and (
                isinstance(v, bool) or not isinstance(v, (int, float))):
            return "must be a number"
        try:
            # what the engine will be given: the value as a command-line word
            p.type.convert(v if isinstance(v, str) else str(v), p, None)
        except click.BadParameter as exc:
            # a value past its flag's bound: the bound alone (engine/flags.py's
            # OutOfBound.allowed), since the refusal line names the key and value already
            return getattr(exc, "allowed", None) or exc.message.rstrip(".")
    return None
