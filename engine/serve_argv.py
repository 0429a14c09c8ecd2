"""A `vllm serve` command line turned into `zerod serve`'s own before click parses it.

vLLM's argparse takes things click does not: the model as the first positional
argument, several values after one flag (`--served-model-name a b`), `--config
FILE.yaml`, and flags zerod has no option for. Here each becomes zerod's form,
an info line (a no-op flag) or a one-line refusal naming what zerod does instead
(engine/vllm_compat.py says which); a flag neither table knows is left for click,
which names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from .flags import BY_SPELLING
from .vllm_compat import FOREIGN, REFUSED_VALUES

# -O3, -O.level=3: vLLM's compilation level, attached to the flag
_COMPILATION = re.compile(r"^-O(\d|\.\S*|\{.*)$")


class Refused(click.ClickException):
    """A vLLM flag (or value) zerod does not serve: one line, exit 2 as any bad flag."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"zerod serve: error: {self.message}", err=True, file=file)


def normalize(args: list[str]) -> tuple[list[str], list[str]]:
    """(zerod serve's own argv, the info lines of the no-op flags)."""
    args = _expand_config(list(args))
    out: list[str] = []
    notes: list[str] = []
    positional_model: str | None = None
    i = 0
    while i < len(args):
        tok = args[i]
        i += 1
        if tok == "--":
            out += args[i - 1:]
            break
        value_inline = None
        if tok.startswith("--") and "=" in tok:
            tok, value_inline = tok.split("=", 1)
        if _COMPILATION.match(tok):
            notes.append(f"{tok}: {FOREIGN['-O'].note}")
            continue
        own = BY_SPELLING.get(tok)
        if own is not None:
            if not own.takes_value or tok.startswith("--no-"):
                out.append(tok)
                continue
            values, i = _values(args, i, value_inline, many=own.many)
            if not values:
                out.append(tok)  # click names the missing value
                continue
            for v in values:
                _check_value(tok, own, v)
                out += [tok, v]
            continue
        foreign = FOREIGN.get(tok)
        if foreign is not None:
            values, i = _foreign_values(args, i, value_inline, foreign.arity)
            shown = f"{tok} {' '.join(values)}".strip()
            if foreign.maps_to:
                out += [foreign.maps_to, *values]
                notes.append(f"{shown}: taken as {foreign.maps_to} ({foreign.note})")
            elif foreign.refused and not (values and values[0] in foreign.harmless):
                raise Refused(f"{shown}: not served: {foreign.note}")
            else:
                notes.append(f"{shown}: no effect: {foreign.note}")
            continue
        if tok.startswith("-") and tok != "-":
            out.append(tok if value_inline is None else f"{tok}={value_inline}")
            continue
        if positional_model is None:  # `vllm serve MODEL`
            positional_model = tok
            out += ["--model", tok]
        else:
            out.append(tok)  # click refuses the extra argument, naming it
    return out, notes


def _values(args: list[str], i: int, inline: str | None, many: bool) -> tuple[list[str], int]:
    if inline is not None:
        return [inline], i
    values = []
    while i < len(args) and (not values or many) and not _is_flag(args[i]):
        values.append(args[i])
        i += 1
    return values, i


def _foreign_values(args: list[str], i: int, inline: str | None,
                    arity: str) -> tuple[list[str], int]:
    if inline is not None:
        return [inline], i
    if arity == "flag":
        return [], i
    if arity == "many":
        return _values(args, i, None, many=True)
    if i < len(args) and (arity == "value" or not _is_flag(args[i])):
        return [args[i]], i + 1
    return [], i


def _is_flag(tok: str) -> bool:
    # a negative number is a value (`--max-model-len -1`)
    return tok.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", tok)


def _check_value(tok: str, flag, value: str) -> None:
    """A value of zerod's own flag that only vLLM serves: refused with the reason."""
    why = REFUSED_VALUES.get(tok)
    choices = getattr(flag.kind, "choices", None)
    if why and choices is not None and value not in choices:
        raise Refused(f"{tok} {value}: not served: {why} (zerod takes: {', '.join(choices)})")


# --------------------------------------------------------------------------- --config


def _expand_config(args: list[str]) -> list[str]:
    """`--config FILE.yaml` (vLLM's: keys are flag names, with dashes or underscores)
    becomes flags placed before the command line's own, so the command line wins."""
    out, files = [], []
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--config":
            if i + 1 >= len(args):
                raise Refused("--config needs a YAML file")
            files.append(args[i + 1])
            i += 2
            continue
        if tok.startswith("--config="):
            files.append(tok.split("=", 1)[1])
        else:
            out.append(tok)
        i += 1
    front: list[str] = []
    for f in files:
        front += config_file_args(f)
    return front + out


def config_file_args(path: str) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as exc:
        raise Refused(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise Refused(f"--config {path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise Refused(f"--config {path}: must be a mapping of flag names to values "
                      "(e.g. max-model-len: 32k)")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if key in ("model", "model_tag", "model-tag"):
            flag = "--model"
        own = BY_SPELLING.get(flag)
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif own is not None and own.negatable:
                argv.append(f"--no-{flag[2:]}")
            continue
        if isinstance(value, list):
            for v in value:
                argv += [flag, _word(v)]
            continue
        argv += [flag, _word(value)]
    return argv


def _word(value) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
