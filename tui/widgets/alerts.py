"""The alert feed, newest first, firing and resolved."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from zerod.tui import format as fmt
from zerod.tui.widgets.fit import refill, widths

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def newest_first(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def key(a: dict[str, Any]) -> float:
        return max(fmt.num(a.get("starts_at")) or 0.0, fmt.num(a.get("ends_at")) or 0.0)
    return sorted(alerts, key=key, reverse=True)


class AlertTable(DataTable):
    BINDINGS = [Binding("enter", "select_cursor", "Details")]

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self.alerts: list[dict[str, Any]] = []
        self._shape: tuple | None = None
        self._args: tuple | None = None

    def on_resize(self) -> None:
        if self._args is not None:
            self.show(*self._args)

    def alert(self, key: str | None) -> dict[str, Any] | None:
        for i, a in enumerate(self.alerts):
            if self._key(a, i) == key:
                return a
        return None

    @staticmethod
    def _key(a: dict[str, Any], i: int) -> str:
        return str(a.get("id") or f"#{i}")

    def show(self, alerts: list[dict[str, Any]], now: float, narrow: bool) -> None:
        self._args = (alerts, now, narrow)
        self.alerts = newest_first([a for a in alerts if isinstance(a, dict)])
        cols = ("", "ALERT", "WHEN") if narrow else ("STATE", "SEVERITY", "ALERT", "WHEN", "SUMMARY")
        rows = [self._cells(a, now, narrow) for a in self.alerts]
        keys = [self._key(a, i) for i, a in enumerate(self.alerts)]
        avail = (self.size.width or self.app.size.width) - 1
        ws = widths(cols, rows, 1 if narrow else len(cols) - 1, avail, flex_min=6)
        shape = (cols, tuple(ws), tuple(keys), tuple(tuple(map(str, r)) for r in rows))
        if shape == self._shape:
            return
        self._shape = shape
        refill(self, cols, ws, list(zip(keys, rows)))

    @staticmethod
    def _cells(a: dict[str, Any], now: float, narrow: bool) -> list[Text | str]:
        firing = a.get("state") == "firing"
        state = Text("● firing", "bold red") if firing else Text("✓ resolved", "green")
        name = Text(str(a.get("alertname") or "?"), "bold" if firing else "dim")
        if firing:
            when = Text(f"for {fmt.duration(now - (fmt.num(a.get('starts_at')) or now))}")
        else:
            when = Text(f"ended {fmt.ago(a.get('ends_at'), now)}", "dim")
        if narrow:
            if not firing:
                when = Text(fmt.ago(a.get("ends_at"), now), "dim")
            return [Text(state.plain[:1], state.style), name, when]
        sev = str(a.get("severity") or "?")
        summary = Text(str(a.get("summary") or ""), "" if firing else "dim")
        return [state, Text(sev, SEVERITY_STYLE.get(sev, "") if firing else "dim"), name, when, summary]
