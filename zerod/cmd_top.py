"""`zerod top [--socket PATH]`: the live dashboard (zerod.tui), a client of the
daemon's control API. Textual is imported only when this command runs."""

from __future__ import annotations

import click

from zerod.daemon_config import default_socket
from zerod import CONTEXT_SETTINGS

DEFAULT_SOCKET = default_socket()


def _configured_socket(config_path: str | None) -> str:
    """[daemon] control_socket of the config file (the daemon's own), else the default."""
    from zerod.config import ConfigError, load_config

    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        if config_path is not None:
            raise click.ClickException(str(exc)) from None
        return DEFAULT_SOCKET  # an unreadable default config must not stop the dashboard
    value = cfg.get("daemon", {}).get("control_socket")
    return value if isinstance(value, str) and value else DEFAULT_SOCKET


@click.command(name="top", context_settings=CONTEXT_SETTINGS)
@click.option("--socket", "socket_path", default=None, envvar="ZEROD_CONTROL_SOCKET", metavar="PATH",
              help=f"The daemon's control socket. Default: [daemon] control_socket of the config, "
                   f"else {DEFAULT_SOCKET}.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The daemon's TOML config, read for [daemon] control_socket (default /etc/zerod/zerod.toml).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.2, 60.0),
              help="Seconds between polls of the daemon.")
def top(socket_path: str | None, config_path: str | None, interval: float) -> None:
    """The live terminal dashboard: GPUs, engine, GPU processes, alerts."""
    if socket_path is None:
        socket_path = _configured_socket(config_path)
    from zerod.tui.app import run

    run(socket_path, interval=interval)
