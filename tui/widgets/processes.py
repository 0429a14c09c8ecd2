"""The GPU processes table: the engine's own marked, foreign ones highlighted with why."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable, Input

from zerod.tui import format as fmt
from zerod.tui.widgets.fit import refill, widths

ROLE_ORDER = {"foreign": 0, "engine": 1, "daemon": 2, "allowed": 3}
ROLE_CELL = {"foreign": ("⚠ foreign", "bold red"), "engine": ("★ engine", "bold green"),
             "daemon": ("◆ daemon", "cyan"), "allowed": ("✓ allowed", "dim")}
SEARCH_KEYS = ("pid", "name", "cmdline", "user", "unit", "container", "role", "known_agent", "why")


def matches(proc: dict[str, Any], needle: str) -> bool:
    needle = needle.strip().lower()
    if not needle:
        return True
    return any(needle in str(proc.get(k) or "").lower() for k in SEARCH_KEYS)


def ordered(procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(procs, key=lambda p: (ROLE_ORDER.get(p.get("role"), 9),
                                        -(fmt.num(p.get("gpu_memory_bytes")) or 0.0),
                                        fmt.num(p.get("pid")) or 0.0))


class FilterInput(Input):
    BINDINGS = [Binding("escape", "clear_filter", "Clear filter")]

    def action_clear_filter(self) -> None:
        self.value = ""
        self.app.action_close_filter()


class ProcessTable(DataTable):
    BINDINGS = [Binding("enter", "select_cursor", "Details")]

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.procs: list[dict[str, Any]] = []
        self.filter = ""
        self._shape: tuple | None = None
        self._narrow = False

    def on_resize(self) -> None:
        if self.procs:
            self.show(self.procs, self._narrow)

    def process(self, pid: str | None) -> dict[str, Any] | None:
        for p in self.procs:
            if str(p.get("pid")) == pid:
                return p
        return None

    def selected(self) -> dict[str, Any] | None:
        if not self.row_count:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:
            return None
        return self.process(key)

    def show(self, procs: list[dict[str, Any]], narrow: bool) -> list[dict[str, Any]]:
        self.procs = [p for p in procs if isinstance(p, dict)]
        self._narrow = narrow
        rows = [p for p in ordered(self.procs) if matches(p, self.filter)]
        avail = (self.size.width or self.app.size.width) - 1
        wide = not narrow and avail >= 150
        if narrow:
            cols = ("PID", "", "NAME", "GPU MEM")
        elif wide:
            cols = ("PID", "GPU", "ROLE", "NAME", "GPU MEM", "USER", "UNIT / CONTAINER", "WHY")
        else:
            cols = ("PID", "GPU", "ROLE", "NAME", "GPU MEM", "UNIT / CONTAINER", "WHY")
        cells = [self._cells(p, narrow, wide) for p in rows]
        ws = widths(cols, cells, len(cols) - 1 if not narrow else 2, avail, flex_min=6)
        shape = (cols, tuple(ws), tuple(str(p.get("pid")) for p in rows), tuple(tuple(map(str, c)) for c in cells))
        if shape == self._shape:
            return rows
        self._shape = shape
        refill(self, cols, ws, [(str(p.get("pid")), c) for p, c in zip(rows, cells)])
        return rows

    @staticmethod
    def _cells(p: dict[str, Any], narrow: bool, wide: bool) -> list[Text | str]:
        role = p.get("role") or "?"
        label, style = ROLE_CELL.get(role, (str(role), ""))
        foreign = role == "foreign"
        name = Text(str(p.get("name") or "?"), "bold red" if foreign else ("bold" if role == "engine" else ""))
        if p.get("known_agent"):
            name.append(" (agent)", "red")
        mem = Text(fmt.bytes_h(p.get("gpu_memory_bytes")), justify="right")
        pid = Text(str(p.get("pid")), "bold red" if foreign else "")
        if narrow:
            return [pid, Text(label[:1], style), name, mem]
        gpu = p.get("gpu")
        where = str(p.get("unit") or (p.get("container") and f"container {p.get('container')}") or fmt.NA)
        if len(where) > 26:
            where = where[:25] + "…"
        why = Text(str(p.get("why") or ""), "red" if foreign else "dim")
        cells: list[Text | str] = [pid, str(gpu) if gpu is not None else "?", Text(label, style), name, mem]
        if wide:
            cells.append(str(p.get("user") or fmt.NA))
        return cells + [where, why]
