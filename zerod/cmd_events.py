"""`zerod events` and `zerod bundle`: what the daemon remembers, read from the
event store under `[daemon] state_dir` — also while the daemon is down.

Exit codes: 0 done; 1 the store or the bundle cannot be read or written (one line
on stderr); 2 bad options or a bad config (click's usage errors).
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime

import click

from zerod import CONTEXT_SETTINGS

SINCE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
SEVERITY_CHOICES = ("critical", "warning", "info")


def parse_since(text: str, now: float | None = None) -> float:
    """'2h', '30m', '1d' (ago), or an ISO 8601 time -> a Unix time."""
    now = time.time() if now is None else now
    m = SINCE.fullmatch(text.strip())
    if m:
        return now - float(m.group(1)) * UNIT_S[m.group(2)]
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a duration (90s, 30m, 2h, 7d, 1w) or an ISO time "
                                 f"(2026-12-03T02:00:00Z)", param_hint="--since") from None
    return t.timestamp() if t.tzinfo else t.astimezone().timestamp()


def _config(path: str | None) -> tuple[dict, object]:
    from zerod.config import ConfigError, load_config
    from zerod.daemon_config import DaemonConfig, DaemonConfigError

    try:
        config = load_config(path)
        return config, DaemonConfig.from_dict(config.get("daemon"))
    except (ConfigError, DaemonConfigError) as exc:
        raise click.UsageError(str(exc).replace("\n", "; ")) from None


def _severities(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for v in values:
        for s in v.split(","):
            s = s.strip().lower()
            if s not in SEVERITY_CHOICES:
                raise click.BadParameter(f"{s!r}: must be one of {', '.join(SEVERITY_CHOICES)}",
                                         param_hint="--severity")
            out.append(s)
    return tuple(out)


def format_event(e: dict) -> str:
    engine = f" engine={e['engine']}" if e.get("engine") else ""
    return f"{e['time']}  {e['severity']:<8} {e['alertname']:<20} {e['state']:<9}{engine}  {e['summary']}"


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--config", type=click.Path(dir_okay=False), metavar="FILE",
              help="zerod.toml (default /etc/zerod/zerod.toml): its [daemon] state_dir.")
@click.option("--since", default="24h", show_default=True, metavar="WHEN",
              help="A duration ago (90s, 30m, 2h, 7d) or an ISO time.")
@click.option("--severity", multiple=True, metavar="LEVEL",
              help="Only these: critical, warning, info (repeatable or comma-separated).")
@click.option("--engine", metavar="NAME",
              help="Only this engine's events ('default': the [engine] engine and the host's).")
@click.option("--json", "as_json", is_flag=True, help="One JSON array: an object per event.")
def events(config, since, severity, engine, as_json):
    """Alert transitions and daemon events kept under [daemon] state_dir, oldest first."""
    from zerod.event_store import EventStore, EventStoreError

    t0 = parse_since(since)
    sev = _severities(severity)
    _, cfg = _config(config)
    try:
        rows = EventStore.for_reading(cfg.state_dir).query(since=t0, severities=sev, engine=engine)
    except EventStoreError as exc:
        click.echo(f"zerod events: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    elif not rows:
        click.echo(f"no events since {datetime.fromtimestamp(t0).isoformat(timespec='seconds')}", err=True)
    else:
        for e in rows:
            click.echo(format_event(e))


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--config", type=click.Path(dir_okay=False), metavar="FILE",
              help="zerod.toml (default /etc/zerod/zerod.toml).")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False), metavar="FILE.tar.gz",
              help="Where to write the bundle.")
def bundle(config, out):
    """Write a support bundle: facts, doctor, last diag, events, engine figures, kernel NVIDIA lines, config."""
    from zerod.bundle import write_bundle

    if not out.endswith((".tar.gz", ".tgz")):
        raise click.BadParameter(f"{out!r}: the bundle is a gzipped tar: name it FILE.tar.gz", param_hint="-o")
    conf, cfg = _config(config)
    try:
        manifest = write_bundle(out, conf, cfg.state_dir, control_socket=cfg.control_socket)
    except OSError as exc:
        click.echo(f"zerod bundle: cannot write {out}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    click.echo(f"{out}: {', '.join(manifest['parts'])}")
    for name, why in sorted(manifest["missing"].items()):
        click.echo(f"  not included: {name}: {why}", err=True)
