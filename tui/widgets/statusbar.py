"""The top line: host, daemon, engine state, alerts, write actions, freshness."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from zerod.tui.widgets.line import Line

from zerod.tui import format as fmt

ENGINE_STYLE = {"healthy": "bold green", "starting": "yellow", "restarting": "yellow",
                "unhealthy": "bold red", "stopped": "bold red"}


def status_line(status: dict[str, Any], alerts: dict[str, Any], *, now: float,
                taken_at: float | None, paused: bool, unreachable: bool, narrow: bool) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(" zerod top ", "bold reverse")
    host = status.get("host")
    if host:
        t.append(f" {host}", "bold")
    if not narrow and status.get("version"):
        t.append(f"  zerod {status.get('version')}", "dim")
    if not narrow and status.get("uptime_s") is not None:
        t.append(f"  up {fmt.duration(status.get('uptime_s'))}", "dim")
    engine = status.get("engine") or {}
    state = engine.get("state")
    if state:
        t.append("  engine ")
        t.append(f"● {state}", ENGINE_STYLE.get(state, "bold"))
    firing = [a for a in (alerts.get("alerts") or []) if isinstance(a, dict) and a.get("state") == "firing"]
    if status or alerts:
        t.append("  ")
        if firing:
            t.append(f"▲ {len(firing)} firing", "bold red")
        else:
            t.append("no alerts firing", "green")
    if status:
        wa = bool(status.get("write_actions"))
        t.append("  writes ", "dim")
        t.append("on" if wa else "off", "bold yellow" if wa else "dim")
    if paused:
        t.append("  ⏸ PAUSED (p)", "bold black on yellow")
    if unreachable:
        t.append("  ✗ daemon unreachable", "bold red")
    elif taken_at is not None and not narrow:
        t.append(f"  updated {fmt.ago(taken_at, now)}", "dim")
    return t


class StatusBar(Line):
    pass
