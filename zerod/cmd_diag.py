"""`zerod diag`: active GPU tests (zerod.diag). torch is imported only here, and
only once the options, the GPUs and the engines on them have been checked.

Exit codes: those of doctor (0 every test passes or is skipped, 1 warnings
only, 2 a test failed, or bad options: click's usage errors), 64 (EX_USAGE)
--gpus names a GPU this host does not have, 75 (EX_TEMPFAIL) an engine serves
on a chosen GPU and --force was not given.
"""

from __future__ import annotations

import json
import re
import sys

import click

from zerod import CONTEXT_SETTINGS
from zerod.cmd_doctor import EXIT_UNKNOWN_CHECK

EXIT_UNKNOWN_GPU = EXIT_UNKNOWN_CHECK  # an operator's typo, as doctor's unknown check ID
EXIT_BUSY = 75  # EX_TEMPFAIL: try again when the engine is stopped, or with --force
EPILOG = ("Exit: 0 every test passes (skips allowed), 1 warnings only (a test that could not run counts "
          "as a warning), 2 a test failed, 64 --gpus names no GPU of this host, 75 an engine serves on "
          "a chosen GPU (--force tests it anyway).")


def parse_gpus(text: str | None) -> list[int] | None:
    """'0,2' or '0-3' or '0,2-3' -> sorted indexes; None for all."""
    if text is None or text.strip() in ("", "all"):
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise click.BadParameter(f"{part!r} is not a GPU index or a range like 0-3", param_hint="--gpus")
        out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(out)


def _daemon_settings(config: str | None) -> tuple[str, str | None]:
    """(control socket, state_dir) from the config's [daemon] table, else the defaults."""
    from zerod.config import ConfigError, load_config
    from zerod.daemon_config import default_socket

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        if config is not None:
            raise click.UsageError(str(exc)) from None
        cfg = {}  # an unreadable default config: the default socket and state directory
    daemon = cfg.get("daemon") or {}
    sock = daemon.get("control_socket")
    state = daemon.get("state_dir")
    return (sock if isinstance(sock, str) and sock else default_socket()), (state if isinstance(state, str) else None)


@click.command(epilog=EPILOG, context_settings=CONTEXT_SETTINGS)
@click.option("--level", type=click.Choice(["quick", "full"]), default="quick", show_default=True,
              help="quick: sized for 30 s a GPU; full: adds a memory pattern test and 30 s of checked GEMMs a GPU.")
@click.option("--gpus", "gpus_text", metavar="LIST", help="GPU indexes (NVML's), e.g. 0,1 or 0-3. Default: all.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--force", is_flag=True, help="Test GPUs an engine serves on (its latency suffers meanwhile).")
@click.option("--config", type=click.Path(dir_okay=False), metavar="FILE",
              help="zerod.toml, read for [daemon] control_socket and state_dir (default /etc/zerod/zerod.toml).")
@click.option("--no-save", is_flag=True, hidden=True, help="Do not keep the result (the daemon keeps its own).")
def diag(level, gpus_text, as_json, force, config, no_save):
    """Active GPU tests: HBM, GEMM (checked against a reference), PCIe and peer bandwidth, health counters."""
    gpus = parse_gpus(gpus_text)
    try:
        code = _diag(level, gpus, as_json, force, config, no_save)
    except click.exceptions.ClickException:
        raise
    except Exception as exc:  # noqa: BLE001 - never a traceback
        click.echo(f"zerod diag: internal error: {type(exc).__name__}: {exc}", err=True)
        code = 2
    sys.exit(code)


def _diag(level: str, gpus: list[int] | None, as_json: bool, force: bool, config: str | None,
          no_save: bool) -> int:
    from zerod.checks.state_dir import diag_result_path
    from zerod.diag import busy, store
    from zerod.diag.nvml_health import read_nvml
    from zerod.diag.runner import run_diag

    sock, state_dir = _daemon_settings(config)
    present = [g["index"] for g in read_nvml().value("nvml.gpus") or []]
    if gpus is not None and present:
        unknown = [g for g in gpus if g not in present]
        if unknown:
            click.echo(f"zerod diag: no GPU {', '.join(map(str, unknown))} on this host; GPUs: "
                       f"{', '.join(map(str, present))}", err=True)
            return EXIT_UNKNOWN_GPU
    if present and not force:
        engines, _why = busy.engines_from_daemon(sock)
        serving = busy.busy(engines, gpus if gpus is not None else present)
        if serving:
            click.echo("zerod diag: refusing: " + "; ".join(serving)
                       + ". Stop it first, or pass --force (its requests slow down while the tests run)", err=True)
            return EXIT_BUSY
    progress = (lambda msg: click.echo(f"  ... {msg}", err=True)) if not as_json and sys.stderr.isatty() else \
        (lambda _msg: None)
    report = run_diag(level, gpus, progress=progress)
    if not no_save:
        path = diag_result_path(state_dir)
        try:
            store.save(report, path)
        except OSError as exc:
            click.echo(f"zerod diag: cannot keep the result in {path}: {exc.strerror or exc}", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=1, default=str))
    else:
        from zerod.diag.render import render

        click.echo(render(report))
    return report["summary"]["exit_code"]
