"""Details of a process or an alert (Enter)."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Static

from zerod.tui import format as fmt

PROCESS_FIELDS = [("pid", "pid"), ("name", "name"), ("role", "role"), ("why", "why"),
                  ("known agent", "known_agent"), ("fix", "fix"), ("gpu", "gpu"),
                  ("GPU memory", "gpu_memory_bytes"), ("SM", "sm_utilization_ratio"), ("host CPU", "cpu_percent"),
                  ("RSS", "rss_bytes"), ("started", "started_at"), ("parent", "ppid"), ("user", "user"), ("unit", "unit"),
                  ("container", "container"), ("first seen", "first_seen"), ("command line", "cmdline")]
ALERT_FIELDS = [("alert", "alertname"), ("state", "state"), ("severity", "severity"), ("summary", "summary"),
                ("description", "description"), ("fix", "fix"), ("labels", "labels"),
                ("started", "starts_at"), ("ended", "ends_at"), ("id", "id")]


def _value(key: str, value: Any, now: float) -> Text:
    if value is None:
        return Text(fmt.NA, "dim")
    if key in ("first_seen", "starts_at", "ends_at", "started_at"):
        return Text(f"{fmt.utc(value)} ({fmt.ago(value, now)})")
    if key == "sm_utilization_ratio":
        return Text(fmt.pct(value))
    if key == "cpu_percent":
        return Text(f"{value:.0f}% of a core" if fmt.num(value) is not None else fmt.NA)
    if key in ("gpu_memory_bytes", "rss_bytes"):
        return Text(fmt.bytes_h(value))
    if key == "labels" and isinstance(value, dict):
        return Text(", ".join(f"{k}={v}" for k, v in sorted(value.items())))
    if key == "fix":
        return Text(str(value), "bold cyan")
    if key in ("role", "state") and value in ("foreign", "firing"):
        return Text(str(value), "bold red")
    return Text(str(value))


def details_table(item: dict[str, Any], fields: list[tuple[str, str]], now: float) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(ratio=1, overflow="fold")
    for label, key in fields:
        table.add_row(label, _value(key, item.get(key), now))
    extra = sorted(set(item) - {k for _, k in fields})
    for key in extra:  # fields a newer daemon sends
        table.add_row(key, _value(key, item.get(key), now))
    return table


class DetailsScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "close", "Close"), Binding("enter", "close", "Close", show=False),
                Binding("q", "close", "Close", show=False)]

    def __init__(self, title: str, item: dict[str, Any], fields: list[tuple[str, str]], now: float) -> None:
        super().__init__()
        self._title = title
        self._item = item
        self._fields = fields
        self._now = now

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="details-box", classes="dialog") as box:
            box.border_title = escape(self._title)
            box.border_subtitle = "Esc to close"
            yield Static(details_table(self._item, self._fields, self._now), id="details-text")

    def action_close(self) -> None:
        self.dismiss(None)
