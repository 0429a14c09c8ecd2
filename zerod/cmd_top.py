"""`zerod top [--socket PATH]`: the live dashboard (zerod.tui), a client of the
daemon's control API. Textual is imported only when this command runs."""

from __future__ import annotations

import click

DEFAULT_SOCKET = "/run/zerod/control.sock"


@click.command(name="top")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              envvar="ZEROD_CONTROL_SOCKET", metavar="PATH",
              help="The daemon's control socket ([daemon] control_socket).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.2, 60.0),
              help="Seconds between polls of the daemon.")
def top(socket_path: str, interval: float) -> None:
    """The live terminal dashboard: GPUs, engine, GPU processes, alerts."""
    from zerod.tui.app import run

    run(socket_path, interval=interval)
