"""The whole configuration file checked before anything starts, and
`zerod config check [FILE]` (like `nginx -t`): OK, or the refusals, one line
each; exit 0 or 78 (EX_CONFIG). `zerod run` refuses the same things the same way.

Each section's schema has one owner: `[daemon]` and `[alerts]` the dataclasses
of zerod.daemon_config, `[doctor]` zerod.checks.config.DoctorConfig (its types
here, its ranges its own), `[engine]` the options of `zerod serve` itself, `[[engines]]` zerod.fleet
(and each entry's flags `zerod serve`'s options).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import click

from zerod.checks.config import DoctorConfig, DoctorConfigError
from zerod.checks.report import CATALOGUE
from zerod.config import ConfigError, load_config
from zerod.config_engine import port_refusals, serve_refusals
from zerod.config_schema import check_options, check_table, refusal
from zerod.daemon_config import AlertsConfig, DaemonConfig, DaemonConfigError
from zerod.engine.cli import serve
from zerod.engines import PRESETS
from zerod.fleet import OWN_KEYS, engine_refusals, engine_specs
from zerod.checks.clock_events import CLOCK_EVENT_REASONS
from zerod import CONTEXT_SETTINGS

EX_OK, EX_CONFIG = 0, 78
MODEL_MISSING = ('[engine] model is not set: set it to a checkpoint directory (config.json, '
                 '*.safetensors) or "demo"; or try zerod without a model: zerod run --demo')


def check_config(config: dict[str, dict[str, Any]], *, demo: bool = False) -> list[str]:
    """Every refusal of the whole file, one line each (empty: OK)."""
    out: list[str] = []
    daemon = _section(config, "daemon", DaemonConfig, out)
    _section(config, "alerts", AlertsConfig, out)
    engine = config.get("engine") or {}
    kind = daemon.engine if daemon else "zerod"
    flag_refusals = _flags(kind, "engine", engine)
    fleet = engine_refusals(config)
    flag_refusals += fleet
    engine_command = daemon.engine_command if daemon else (config.get("daemon") or {}).get("engine_command")
    if config.get("engines") is None:
        if "model" not in engine and not demo and not engine_command:
            out.append(MODEL_MISSING)
        elif not flag_refusals and daemon is not None and kind == "zerod" and not engine_command:
            flag_refusals += serve_refusals("engine", engine, demo)
    elif not fleet:
        for entry, spec in zip(config["engines"], engine_specs(config)):
            own = {k: v for k, v in entry.items() if k not in OWN_KEYS}
            entry_refusals = _flags(kind, f"engines.{spec.name}", own)
            if "model" not in spec.section and not demo and not spec.command:
                out.append(f"[engines.{spec.name}] model is not set (nor in [engine]): " + MODEL_MISSING.split(": ", 1)[1])
            elif (not entry_refusals and not flag_refusals and daemon is not None and kind == "zerod"
                  and not spec.command):
                entry_refusals += serve_refusals(f"engines.{spec.name}", spec.section, demo)
            flag_refusals += entry_refusals
    out += flag_refusals
    if daemon is not None and not fleet:
        out += port_refusals(config, daemon.metrics_host, daemon.metrics_port)
    reasons = (config.get("daemon") or {}).get("throttle_alert_reasons", [])
    if (isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)
            and not set(reasons) <= set(CLOCK_EVENT_REASONS.values())):
        out.append(refusal("daemon", "throttle_alert_reasons", reasons,
                           f"each must be one of {', '.join(CLOCK_EVENT_REASONS.values())}"))
    out += _doctor(config, engine_ok=not flag_refusals)
    return out


def _flags(kind: str, section: str, table: dict[str, Any]) -> list[str]:
    """The engine's flags: zerod serve's own options, or another engine's values.
    `tensor_parallel_size` is accepted explicitly for zerod (a whole number >= 1),
    whether or not this build's `zerod serve` has the option yet."""
    if kind != "zerod":
        return _other_engine(kind, table)
    table = dict(table)
    tp = table.pop("tensor_parallel_size", None)
    out = check_options(serve, section, table)
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        out.append(refusal(section, "tensor_parallel_size", tp, "must be a whole number >= 1"))
    return out


def _other_engine(kind: str, engine: dict[str, Any]) -> list[str]:
    """[engine] for vLLM or SGLang: their own flags, which zerod cannot list; each
    value must make a command-line word (or a list of them, or true/false)."""
    out = []
    for key, value in engine.items():
        items = value if isinstance(value, list) else [value]
        if isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in items):
            out.append(refusal("engine", key, value, "must be a value, a list of values or true/false"))
        elif any(isinstance(v, float) and not math.isfinite(v) for v in items):
            out.append(refusal("engine", key, value, "must be a finite number"))
    if engine.get("api_key") and PRESETS[kind].api_key_env is None:
        out.append(refusal("engine", "api_key", "***", f"{kind} takes its key only on the command line, which every "
                           "user can read in /proc: put an authenticating proxy in front of it instead"))
    return out


def _section(config, name: str, cls, out: list[str]):
    try:
        return cls.from_dict(config.get(name))
    except DaemonConfigError as exc:
        out.extend(exc.refusals)
        return None


def _doctor(config: dict[str, dict[str, Any]], engine_ok: bool) -> list[str]:
    table = config.get("doctor") or {}
    _, out = check_table(DoctorConfig, "doctor", table, scalar_lists=True)
    for cid, why in (table.get("waivers") or {}).items() if isinstance(table.get("waivers"), dict) else ():
        if cid not in CATALOGUE:
            out.append(refusal("doctor", f'waivers."{cid}"', why, "no such check ID (zerod doctor lists them)"))
    if not out and engine_ok:  # its own ranges, and what it takes from [engine]
        try:
            DoctorConfig.from_config(config)
        except (DoctorConfigError, TypeError, ValueError) as exc:
            out.append(str(exc).replace("\n", " "))
    return out


@click.group("config", context_settings=CONTEXT_SETTINGS)
def config() -> None:
    """Check the configuration file."""


@config.command("check", context_settings=CONTEXT_SETTINGS)
@click.argument("path", metavar="[FILE]", required=False)  # zerod.config says what is wrong with it
@click.option("--demo", is_flag=True, help="Check it as `zerod run --demo` would (no model needed).")
def check(path: str | None, demo: bool) -> None:
    """Check FILE (default /etc/zerod/zerod.toml) as `zerod run` would, before
    anything starts: prints OK, or each refusal on one line; exit 0 or 78."""
    from zerod.config import DEFAULT_PATH

    shown = path or str(DEFAULT_PATH)
    try:
        refusals = check_config(load_config(path), demo=demo)
    except ConfigError as exc:
        refusals = [str(exc)]
    if refusals:
        for line in refusals:
            click.echo(line, err=True)
        click.echo(f"{shown}: {len(refusals)} problem(s); zerod run would refuse to start", err=True)
        sys.exit(EX_CONFIG)
    click.echo(f"{shown}: OK")
