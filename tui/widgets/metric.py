"""One labelled metric: a label, a sparkline of its history, the current value."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget

from zerod.tui.widgets.line import Line
from zerod.tui.widgets.spark import Spark


class MetricRow(Widget):
    def __init__(self, label: str, lo: float | None = None, hi: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._label = label
        self._lo = lo
        self._hi = hi

    def compose(self) -> ComposeResult:
        yield Line(self._label, classes="metric-label")
        yield Spark(self._lo, self._hi, classes="metric-spark")
        yield Line("", classes="metric-value")

    def set(self, value: str | Text, data: Sequence[float], lo: float | None = None,
            hi: float | None = None) -> None:
        self.query_one(".metric-value", Line).set(value)
        self.query_one(Spark).set(data, lo=lo, hi=hi)
