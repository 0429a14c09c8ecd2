"""`zerod run` (the daemon in the foreground: what systemd starts) and
`zerod install` (the unit, the sysctl drop-in, the NUMA drop-in)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import click

from zerod.daemon_config import default_socket
from zerod.engine.logs import LOG_FORMATS, setup_logging
from zerod import CONTEXT_SETTINGS


@click.command("run", context_settings=CONTEXT_SETTINGS)
@click.option("--config", "config_path", default=None,  # zerod.config says what is wrong with it
              help="TOML config (default /etc/zerod/zerod.toml).")
@click.option("--demo", is_flag=True,
              help="The built-in demo model; GPU preflight checks waived (runs on a CPU-only machine).")
@click.option("--metrics-port", type=click.IntRange(-1, 65535), default=None,
              help="Override [daemon] metrics_port (0: any free port, -1: none).")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None,
              help=f"Override [daemon] control_socket (default {default_socket()}).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(LOG_FORMATS),
              help="json: one JSON object per log record (under systemd, journald's fields "
                   "either way).")
def run(config_path, demo, metrics_port, control_socket, log_level, log_format):
    """The daemon in the foreground: preflight gate, engine supervision, watchers,
    Prometheus metrics, alerts, control API (what `systemctl start zerod` runs)."""
    from zerod.cmd_config import check_config
    from zerod.config import ConfigError, load_config
    from zerod.daemon import EX_CONFIG, Daemon

    setup_logging(log_level, log_format)
    log = logging.getLogger("zerod")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        log.critical("configuration refused: %s", exc)
        sys.exit(EX_CONFIG)
    if metrics_port is not None:
        config["daemon"]["metrics_port"] = metrics_port
    if control_socket is not None:
        config["daemon"]["control_socket"] = control_socket
    refusals = check_config(config, demo=demo)
    if refusals:
        for line in refusals:
            log.critical("configuration refused: %s", line)
        log.critical("not starting: fix the line(s) above (zerod config check FILE checks a file)")
        sys.exit(EX_CONFIG)
    sys.exit(asyncio.run(Daemon(config, demo=demo).run()))


@click.command("install", context_settings=CONTEXT_SETTINGS)
@click.option("--rootfs", type=click.Path(file_okay=False), default="/", show_default=True,
              help="Write under this root (a chroot, an image, a test directory).")
@click.option("--dry-run", is_flag=True, help="Show what would be written, write nothing.")
@click.option("--exec-start", default=None,
              help="The command line for ExecStart (default: this zerod's own path + ' run').")
@click.option("--gpu", "gpu_index", type=int, default=0, show_default=True,
              help="The GPU whose NUMA node the NUMA drop-in pins the service to.")
@click.option("--sysfs", type=click.Path(file_okay=False), default="/sys", show_default=True,
              help="Where to read the GPU's NUMA node (a recorded /sys in tests).")
def install(rootfs, dry_run, exec_start, gpu_index, sysfs):
    """Write the systemd unit (with the real ExecStart path), the sysctl drop-in,
    the NUMA drop-in for this host, and the example config if none exists."""
    from zerod.install import InstallError, plan_install, write_plan

    try:
        plan = plan_install(rootfs=rootfs, exec_start=exec_start, gpu_index=gpu_index, sysfs=sysfs)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from None
    for note in plan.notes:
        click.echo(f"note: {note}", err=True)
    if dry_run:
        for f in plan.files:
            click.echo(f"--- {f.path} (mode {f.mode:o}){' [kept: exists]' if f.keep_existing and os.path.exists(f.path) else ''}")
            click.echo(f.content.rstrip("\n"))
        click.echo("(dry run: nothing written)")
        return
    try:
        written = write_plan(plan)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from None
    for path, what in written:
        click.echo(f"{what}: {path}")
    if os.path.abspath(rootfs) == "/":
        click.echo("next: systemctl daemon-reload && sysctl --system && systemctl enable --now zerod")
