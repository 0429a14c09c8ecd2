"""`zerod doctor` and `zerod harden`.

Imports nothing heavy: no torch (its CUDA version is read from torch/version.py
as text), no engine, no Textual. Never prints a traceback: an unexpected error
is one line on stderr and exit 2.

Exit codes (docs/checks.md): 0 all pass, 1 warnings only, 2 a check failed (or
bad options, a bad config or snapshot: click's usage errors), 64 (EX_USAGE) an
--only/--skip naming no check, so a typo never reads as a failing host.
"""

from __future__ import annotations

import json
import os
import sys

import click
from zerod import CONTEXT_SETTINGS

EXIT_UNKNOWN_CHECK = 64  # EX_USAGE (sysexits.h)
EPILOG = ("Exit: 0 all checks pass (skips allowed), 1 warnings only (a check that could not "
          "run counts as a warning), 2 any failure, 64 --only/--skip names no check.")


def _load_config(config: str | None, rootfs: str | None) -> dict:
    from zerod.config import DEFAULT_PATH, ConfigError, load_config

    try:
        if config:
            return load_config(config)
        # the default file; a re-rooted host brings its own, if any
        p = os.path.join(rootfs, "etc/zerod/zerod.toml") if rootfs else str(DEFAULT_PATH)
        if not os.path.exists(p):
            return {}
        if not os.access(p, os.R_OK):  # `zerod install` makes it 0640: it may hold the API key
            click.echo(f"zerod doctor: cannot read {p} (permission denied): checking with the default "
                       f"settings; run as root, or in the file's group, to use it", err=True)
            return {}
        return load_config(p)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.command(epilog=EPILOG, context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the report) instead of text.")
@click.option("--only", multiple=True, metavar="ID", help="Run only these checks (ID, area like 'gpu', or glob; repeatable).")
@click.option("--skip", multiple=True, metavar="ID", help="Leave these checks out (ID, area or glob; repeatable).")
@click.option("--procfs", type=click.Path(file_okay=False), help="Read /proc from DIR (default: /proc, or ROOTFS/proc).")
@click.option("--sysfs", type=click.Path(file_okay=False), help="Read /sys from DIR (default: /sys, or ROOTFS/sys).")
@click.option("--rootfs", type=click.Path(file_okay=False), help="Read / (boot, etc, dev) from DIR.")
@click.option("--save-facts", type=click.Path(dir_okay=False), metavar="FILE", help="Write the facts snapshot (a support bundle).")
@click.option("--facts", "facts_file", type=click.Path(dir_okay=False), metavar="FILE", help="Replay a saved snapshot instead of probing this host.")
@click.option("--config", type=click.Path(dir_okay=False), metavar="FILE", help="zerod.toml (default /etc/zerod/zerod.toml).")
@click.option("-v", "--verbose", is_flag=True, help="Show the evidence under each check.")
def doctor(as_json, only, skip, procfs, sysfs, rootfs, save_facts, facts_file, config, verbose):
    """Preflight: read the host and say, check by check, what is wrong and the fix."""
    from zerod.checks.report import UnknownCheck

    try:
        code = _doctor(as_json, only, skip, procfs, sysfs, rootfs, save_facts, facts_file, config, verbose)
    except click.exceptions.ClickException:
        raise
    except UnknownCheck as exc:
        click.echo(f"zerod doctor: {exc}", err=True)
        code = EXIT_UNKNOWN_CHECK
    except Exception as exc:  # noqa: BLE001 - never a traceback
        click.echo(f"zerod doctor: internal error: {type(exc).__name__}: {exc}", err=True)
        code = 2
    sys.exit(code)


def _doctor(as_json, only, skip, procfs, sysfs, rootfs, save_facts, facts_file, config, verbose) -> int:
    from zerod.checks import DoctorConfig, DoctorConfigError, Facts, Roots, probe_facts, run_checks
    from zerod.checks.render import render
    from zerod.checks.report import select_checks

    select_checks(only, skip)  # a typo'd ID: say so before probing anything

    try:
        cfg = DoctorConfig.from_config(_load_config(config, rootfs))
    except DoctorConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if facts_file:
        try:
            facts = Facts.load(facts_file)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"cannot read facts snapshot {facts_file}: {exc}") from None
        facts.host["facts_file"] = facts_file
    else:
        facts = probe_facts(Roots.make(procfs, sysfs, rootfs), cfg)
    if save_facts:
        try:
            facts.save(save_facts)
        except OSError as exc:
            raise click.UsageError(f"cannot write {save_facts}: {exc.strerror}") from None
    report = run_checks(facts, cfg, only=only or None, skip=skip or None)
    if not (facts_file or only or skip or procfs or sysfs or rootfs):
        from zerod.checks import last_report

        last_report.save(report.to_dict())  # for `zerod top` with no daemon; best effort
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        click.echo(render(report, colour=colour, verbose=verbose), color=colour)
    return report.exit_code


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--apply", "do_apply", is_flag=True, help="Apply the plan (records the previous values).")
@click.option("--rollback", is_flag=True, help="Restore the values recorded by --apply.")
@click.option("--rootfs", type=click.Path(file_okay=False), default="/", show_default=True,
              help="Write under DIR instead of / (for tests and image builds).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--exclusive-gpu", is_flag=True,
              help="Also set every GPU to EXCLUSIVE_PROCESS compute mode (through NVML; --rollback restores it).")
@click.option("--enable-io-uring", is_flag=True,
              help="Also set kernel.io_uring_disabled = 0. A security setting: never lowered "
                   "unless asked (zerod itself does not use io_uring).")
def harden(do_apply, rollback, rootfs, as_json, exclusive_gpu, enable_io_uring):
    """Plan (default), apply or roll back the host fixes that are safe to automate.

    With --exclusive-gpu it also sets the GPUs' compute mode, so that no second
    process can create a CUDA context beside the engine. Never touches GPU clocks,
    power limits, persistence, ECC or MIG: for those it prints the command for a
    person to run."""
    from zerod.checks import harden as H

    if do_apply and rollback:
        raise click.UsageError("--apply and --rollback exclude each other")
    if enable_io_uring and rollback:
        raise click.UsageError("--rollback restores every recorded change: leave out --enable-io-uring")
    if exclusive_gpu and rollback:
        raise click.UsageError("--rollback restores every recorded change, compute modes included: "
                               "leave out --exclusive-gpu")
    try:
        if rollback:
            done = H.rollback(rootfs)
            click.echo("\n".join(done) if done else "nothing to roll back (no recorded harden state)")
            sys.exit(0)
        facts = None
        if os.path.realpath(rootfs) == "/":  # the GPU settings to mention are this host's
            from zerod.checks.facts import Facts
            from zerod.checks import probe_nvml

            facts = Facts()
            probe_nvml.probe(facts)
        plan = H.plan(rootfs, facts, exclusive_gpu=exclusive_gpu, enable_io_uring=enable_io_uring)
        if as_json and not do_apply:
            click.echo(json.dumps(plan.to_dict(), indent=1))
            sys.exit(0)
        click.echo(H.render_plan(plan))
        if do_apply:
            done = H.apply(plan)
            click.echo("applied:" if done else "nothing to apply")
            for d in done:
                click.echo(f"  {d}")
            if done:
                click.echo(f"previous values recorded in {os.path.join(rootfs, H.STATE_FILE)}; "
                           "`zerod harden --rollback` restores them")
    except H.HardenRefused as exc:
        click.echo(f"zerod harden: refused: {exc}", err=True)
        sys.exit(1)
    except H.HardenError as exc:
        click.echo(f"zerod harden: {exc}", err=True)
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - never a traceback
        click.echo(f"zerod harden: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(2)
    sys.exit(0)
