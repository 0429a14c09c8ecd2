"""The banner shown while the daemon cannot be reached."""

from __future__ import annotations

from rich.text import Text
from zerod.tui.widgets.line import Line

from zerod.tui import format as fmt


def banner_text(socket_path: str, error: str, *, now: float, down_since: float,
                last_ok: float | None, interval: float) -> Text:
    t = Text()
    t.append("⚠ Cannot reach the zerod daemon at ", "bold")
    t.append(socket_path, "bold underline")
    t.append(f": {error}")
    t.append(f"\n  retrying every {interval:g}s; down for {fmt.duration(now - down_since)}", "dim")
    if last_ok is not None:
        t.append(f"; the panels below show data from {fmt.ago(last_ok, now)}", "dim")
    return t


class Banner(Line):
    pass
