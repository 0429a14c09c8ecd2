"""The `zerod` command line.

Each sub-command lives in the room that owns it and is imported only when it is
run: `zerod doctor` must not pay for importing torch, and `zerod serve` must not
pay for Textual.
"""

from __future__ import annotations

import importlib
import sys

import click

from zerod import CONTEXT_SETTINGS, __version__

# name -> "module:attribute" of a click.Command
COMMANDS: dict[str, str] = {
    "doctor": "zerod.cmd_doctor:doctor",
    "harden": "zerod.cmd_doctor:harden",
    "diag": "zerod.cmd_diag:diag",
    "serve": "zerod.engine.cli:serve",
    "bench": "zerod.bench.cli:bench",
    "run": "zerod.cmd_run:run",
    "install": "zerod.cmd_run:install",
    "top": "zerod.cmd_top:top",
    "config": "zerod.cmd_config:config",
    "events": "zerod.cmd_events:events",
    "bundle": "zerod.cmd_events:bundle",
}

HELP = {
    "doctor": "Preflight: read the host and say, check by check, what is wrong and the fix.",
    "harden": "Plan (default), apply or roll back the host fixes that are safe to automate.",
    "diag": "Active GPU tests: HBM, GEMM checked against a reference, PCIe and peer bandwidth.",
    "serve": "Run the bundled OpenAI-compatible engine alone.",
    "bench": "Drive a running engine over HTTP and report TTFT, ITL and throughput.",
    "run": "The daemon in the foreground (what systemd starts).",
    "install": "Write the systemd unit, the sysctl drop-in and the NUMA drop-in.",
    "top": "The live terminal dashboard.",
    "config": "Check the configuration file (zerod config check [FILE]).",
    "events": "What happened on this host: alert transitions and daemon events, kept on disk.",
    "bundle": "Write a support bundle (.tar.gz) for a ticket.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            # A missing optional part must say so, not print a traceback.
            return _unavailable(name, exc)
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing the commands must not import them all.
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP[name]) for name in COMMANDS])


def _unavailable(name: str, exc: ImportError) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def unavailable(args: tuple[str, ...]) -> None:
        raise click.ClickException(f"`zerod {name}` is not available here: {exc}")

    return unavailable


@click.group(cls=LazyGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="zerod")
def cli() -> None:
    """zerod: preflight, supervise and serve LLM inference on NVIDIA GPUs."""


def main() -> None:
    try:
        cli(prog_name="zerod")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
