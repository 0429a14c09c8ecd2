"""The engine's flags checked as `zerod serve` itself takes them, before the daemon starts.

`zerod config check` and `zerod run` must refuse what the engine would refuse at its own
start (exit 78 once, instead of an engine that fails and is restarted forever): so the
flags the daemon would pass are parsed by `zerod serve`'s own click command (its types,
ranges and callbacks: the model directory, --lora-modules) and built into its
EngineConfig (its bounds), and the endpoints the daemon opens must not collide with the
engine's port.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from zerod.config_schema import refusal
from zerod.engine.cli import serve
from zerod.engine.config import EngineConfig, EngineError
from zerod.engines import PRESETS

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def serve_refusals(section: str, flags: dict[str, Any], demo: bool = False) -> list[str]:
    """What `zerod serve` would refuse in these [engine] flags, one line each."""
    flags = dict(flags)
    if demo:
        flags.setdefault("model", "demo")
    argv = PRESETS["zerod"].argv(flags)[4:]   # after `python -m zerod serve`
    try:
        ctx = serve.make_context("serve", argv)
    except click.ClickException as exc:
        return [f"[{section}] {_one_line(exc.format_message())} (zerod serve)"]
    params = ctx.params
    out = []
    if params.get("enable_auto_tool_choice") and params.get("tool_call_parser") is None:
        out.append(f"[{section}] enable_auto_tool_choice needs tool_call_parser")
    if (params.get("lora_modules") or params.get("allow_runtime_lora")) and not params.get("enable_lora"):
        out.append(f"[{section}] lora_modules and allow_runtime_lora need enable_lora = true")
    for name, path, _ in params.get("lora_modules") or ():
        if not Path(path).expanduser().is_dir():
            out.append(refusal(section, "lora_modules", f"{name}={path}",
                               f"{path} is not a directory (a PEFT adapter directory)"))
    template = params.get("chat_template")
    if template is not None and not Path(template).is_file():
        out.append(refusal(section, "chat_template", template, "is not a readable file"))
    values = {k: v for k, v in params.items() if k in _CONFIG_FIELDS}
    names = values.pop("served_model_name", ()) or ()
    try:
        EngineConfig(served_model_name=names[0] if names else None, **values)
    except (EngineError, ValueError, TypeError) as exc:
        out.append(f"[{section}] {_one_line(str(exc))}")
    return out


def port_refusals(config: dict[str, Any], metrics_host: str, metrics_port: int) -> list[str]:
    """The daemon's /metrics port must not be an engine's: one of them could not bind."""
    if metrics_port <= 0:
        return []
    shared = config.get("engine") or {}
    entries = config.get("engines") or [shared]
    out = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, dict):
            continue
        port = entry.get("port", shared.get("port", PRESETS["zerod"].default_port))
        host = str(entry.get("host", shared.get("host", "127.0.0.1")))
        if port == metrics_port and _overlap(host, metrics_host):
            where = "engine" if entries is not config.get("engines") else f"engines.{entry.get('name', i)}"
            out.append(refusal(where, "port", port, f"is [daemon] metrics_port too: the engine and "
                               "the daemon's /metrics cannot both listen there"))
    return out


def _overlap(a: str, b: str) -> bool:
    wildcard = ("0.0.0.0", "::", "[::]", "")
    return a == b or a in wildcard or b in wildcard


def _one_line(text: str) -> str:
    return " ".join(text.split())
