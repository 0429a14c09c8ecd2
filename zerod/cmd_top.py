"""`zerod top [--socket PATH]`: the live dashboard (zerod.tui), a client of the
daemon's control API. Textual is imported only when this command runs."""

from __future__ import annotations

import os

import click

from zerod.daemon_config import default_socket
from zerod import CONTEXT_SETTINGS

DEFAULT_SOCKET = default_socket()


def _config(config_path: str | None) -> dict:
    """The daemon's config file, {} when the default one cannot be read (it must not stop
    the dashboard); a --config FILE that cannot be read is an error."""
    from zerod.config import ConfigError, load_config

    try:
        return load_config(config_path)
    except ConfigError as exc:
        if config_path is not None:
            raise click.ClickException(str(exc)) from None
        return {}


def _configured_socket(cfg: dict) -> str:
    """[daemon] control_socket of the config (the daemon's own), else the default."""
    value = cfg.get("daemon", {}).get("control_socket")
    return value if isinstance(value, str) and value else DEFAULT_SOCKET


def _allowed(cfg: dict) -> tuple[str, ...]:
    """[doctor] allowed_gpu_processes, so standalone mode tags them as doctor does."""
    value = cfg.get("doctor", {}).get("allowed_gpu_processes")
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


@click.command(name="top", context_settings=CONTEXT_SETTINGS)
@click.option("--socket", "socket_path", default=None, envvar="ZEROD_CONTROL_SOCKET", metavar="PATH",
              help=f"The daemon's control socket. Default: [daemon] control_socket of the config, "
                   f"else {DEFAULT_SOCKET}.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The daemon's TOML config, read for [daemon] control_socket (default /etc/zerod/zerod.toml).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.2, 60.0),
              help="Seconds between polls of the daemon.")
@click.option("--once", is_flag=True,
              help="Print what the dashboard would show once and exit 0, without a terminal (scripts, tickets).")
@click.option("--json", "as_json", is_flag=True,
              help="With --once: one JSON document (gpus, processes, engines, alerts, checks) instead of text.")
@click.option("--no-standalone", "no_standalone", is_flag=True,
              help="With no daemon, show its banner only instead of reading NVML and /proc here.")
def top(socket_path: str | None, config_path: str | None, interval: float, once: bool, as_json: bool,
        no_standalone: bool) -> None:
    """The live terminal dashboard: GPUs, engine, GPU processes, alerts. With no daemon
    running it reads this host itself (standalone mode)."""
    if as_json and not once:
        raise click.UsageError("--json goes with --once: `zerod top --once --json`")
    cfg = _config(config_path)
    if socket_path is None:
        socket_path = _configured_socket(cfg)
    allowed = _allowed(cfg)
    if once:
        import sys
        import time

        from zerod.tui.client import ControlClient
        from zerod.tui.once import print_once

        local = None if no_standalone else _standalone(allowed)
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        code = print_once(ControlClient(socket_path), local, as_json=as_json, now=time.time(), out=sys.stdout,
                          colour=colour)
        sys.exit(code)
    from zerod.tui.app import run

    run(socket_path, interval=interval, local=None if no_standalone else _standalone(allowed))


def _standalone(allowed: tuple[str, ...]):
    """The reader of this host for standalone mode."""
    from zerod.tui.local_source import LocalSource

    return LocalSource(allowed=allowed).snapshot
