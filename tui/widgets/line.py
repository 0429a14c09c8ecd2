"""A Static that repaints only when its content changes, and by default without a
layout pass (its size is fixed by the stylesheet). Polls arrive every second and most
of what they carry is unchanged: skipping those repaints keeps the dashboard near idle."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static


class Line(Static):
    _last: Any = None

    def set(self, content: Any, *, layout: bool = False) -> None:
        if content == self._last and type(content) is type(self._last):
            return
        self._last = content
        self.update(content, layout=layout)



def set_title(widget: Any, title: Any) -> None:
    """Set a border title only when it changes: setting it repaints the whole panel."""
    last = getattr(widget, "_zt_title", None)
    if last is not None and type(last) is type(title) and last == title:
        return
    widget._zt_title = title
    widget.border_title = title
