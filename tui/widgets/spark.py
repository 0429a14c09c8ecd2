"""A one-line sparkline of a history array (one sample per second, oldest first).

Unlike textual's Sparkline it can pin its scale (`lo`/`hi`, e.g. 0..100 % for
utilization, 0..limit for power) so a flat 97 % does not look like a flat 0 %, and it
right-aligns short histories so time always runs to the right edge.
"""

from __future__ import annotations

from typing import Sequence

from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def resample(data: Sequence[float], width: int) -> list[float]:
    """`width` buckets (max of each) of the data, or the data itself when it fits."""
    n = len(data)
    if width <= 0 or n == 0:
        return []
    if n <= width:
        return list(data)
    return [max(data[k * n // width:(k + 1) * n // width] or [data[min(n - 1, k * n // width)]])
            for k in range(width)]


def levels(data: Sequence[float], lo: float | None, hi: float | None) -> list[int]:
    """0..7 per value: pinned bounds where given, the data's own range otherwise.

    A flat series has no range to scale against: at zero, or at the pinned low bound
    (an idle engine: 0 requests, 0 tokens/s), it draws the lowest bar; elsewhere the
    middle one.
    """
    if not data:
        return []
    low = min(data) if lo is None else lo
    high = max(data) if hi is None else hi
    if high <= low:
        return [0 if v <= (0 if lo is None else lo) else 3 for v in data]
    top = len(BARS) - 1
    return [max(0, min(top, int(round((v - low) / (high - low) * top)))) for v in data]


class Spark(Widget):
    COMPONENT_CLASSES = {"spark--low", "spark--high"}

    data: reactive[tuple[float, ...]] = reactive(tuple, layout=False)

    def __init__(self, lo: float | None = None, hi: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lo = lo
        self.hi = hi

    def set(self, data: Sequence[float], lo: float | None = None, hi: float | None = None) -> None:
        changed = False
        if lo is not None and lo != self.lo:
            self.lo, changed = lo, True
        if hi is not None and hi != self.hi:
            self.hi, changed = hi, True
        data = tuple(data)
        if data != self.data:
            self.data = data  # a reactive: repaints itself
        elif changed:
            self.refresh()

    def render(self) -> Text:
        width = self.size.width
        values = resample(self.data, width)
        lv = levels(values, self.lo, self.hi)
        low = self.get_component_styles("spark--low").color
        high = self.get_component_styles("spark--high").color
        text = Text(" " * (width - len(lv)), no_wrap=True, overflow="crop")
        top = len(BARS) - 1
        for level in lv:
            color = low.blend(high, level / top)
            text.append(BARS[level], Style(color=color.rich_color))
        return text
