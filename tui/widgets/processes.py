"""The GPU processes table, as nvitop shows them: GPU memory, SM %, host CPU %, RSS,
user, elapsed time and command per process, tagged (foreign, engine, zerod,
allowed); sorted by any column, filtered, or as a tree (tui/process_view.py)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable, Input

from zerod.tui import format as fmt
from zerod.tui import process_view as pv
from zerod.tui.widgets.fit import refill, widths

WIDE_FROM = 150  # columns of the table from which USER shows


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
        self.foreign_only = False
        self.gpu: int | None = None
        self.sort_key = pv.DEFAULT_SORT
        self.sort_flipped = False  # against the column's natural direction
        self.as_tree = False
        self.several_engines = False
        self.now = 0.0
        self._shape: tuple | None = None
        self._narrow = False

    def on_resize(self) -> None:
        if self.procs:
            self.show(self.procs, self._narrow, self.now, self.several_engines)

    # ---------------------------------------------------------------- state
    @property
    def sort_reverse(self) -> bool:
        return (self.sort_key in pv.DESCENDING_FIRST) != self.sort_flipped

    def cycle_sort(self, step: int) -> str:
        keys = [c.key for c in pv.COLUMNS]
        self.sort_key = keys[(keys.index(self.sort_key) + step) % len(keys)]
        self.sort_flipped = False
        return self.sort_key

    def current_filter(self) -> pv.Filter:
        return pv.Filter.parse(self.filter, foreign_only=self.foreign_only, gpu=self.gpu)

    def describe(self) -> str:
        """The table's view in words, for its title: sort, tree, filter."""
        col = pv.BY_KEY[self.sort_key]
        parts = [f"sort {col.label.lower()} {'▼' if self.sort_reverse else '▲'}"]
        if self.as_tree:
            parts.append("tree")
        return " · ".join(parts)

    def process(self, key: str | None) -> dict[str, Any] | None:
        for p in self.procs:
            if str(p.get("pid")) == key:
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

    # ---------------------------------------------------------------- rows
    def visible(self, procs: list[dict[str, Any]], now: float) -> list[pv.TreeRow]:
        keep = self.current_filter()
        rows = pv.sort_rows([p for p in procs if keep(p)], self.sort_key, self.sort_reverse, now)
        if self.as_tree:
            return pv.tree(rows)
        return [pv.TreeRow(p, 0, True, False) for p in rows]

    def show(self, procs: list[dict[str, Any]], narrow: bool, now: float = 0.0,
             several_engines: bool = False) -> list[dict[str, Any]]:
        self.procs = [p for p in procs if isinstance(p, dict)]
        self._narrow, self.now, self.several_engines = narrow, now, several_engines
        rows = self.visible(self.procs, now)
        avail = (self.size.width or self.app.size.width) - 1
        wide = not narrow and avail >= WIDE_FROM
        keys = ["pid", "tag", "command", "gpu_mem"] if narrow else \
            ["pid", "gpu", "tag"] + (["user"] if wide else []) + ["gpu_mem", "sm", "cpu", "rss", "time", "command"]
        cols = tuple(self._label(k, narrow) for k in keys)
        cells = [self._cells(r, keys, narrow) for r in rows]
        ws = widths(cols, cells, keys.index("command"), avail, flex_min=6)
        shape = (cols, tuple(ws), tuple(self._key(r) for r in rows), tuple(tuple(map(str, c)) for c in cells))
        if shape != self._shape:
            self._shape = shape
            refill(self, cols, ws, [(self._key(r), c) for r, c in zip(rows, cells)])
        return [r.proc for r in rows if not r.ancestor]

    def _label(self, key: str, narrow: bool) -> str:
        label = {"tag": "", "command": "NAME"}.get(key, pv.BY_KEY[key].label) if narrow else pv.BY_KEY[key].label
        if key == self.sort_key:
            label += "▼" if self.sort_reverse else "▲"
        return label

    @staticmethod
    def _key(r: pv.TreeRow) -> str:
        return f"parent-{r.proc.get('pid')}" if r.ancestor else str(r.proc.get("pid"))

    def _cells(self, r: pv.TreeRow, keys: list[str], narrow: bool) -> list[Text | str]:
        p = r.proc
        role = p.get("role")
        foreign = role == "foreign"
        label, style = pv.tag(p, self.several_engines)
        dim = "dim" if r.ancestor else ""
        branch = ("  " * (r.depth - 1) + ("└ " if r.last else "├ ")) if r.depth else ""
        out: list[Text | str] = []
        for k in keys:
            if k == "pid":
                out.append(Text(str(p.get("pid")), "bold red" if foreign else dim, justify="right"))
            elif k == "gpu":
                out.append(Text("" if r.ancestor else (fmt.NA if p.get("gpu") is None else str(p["gpu"])), dim))
            elif k == "tag":
                out.append(Text(label[:1] if narrow else label, style))
            elif k == "user":
                out.append(Text(str(p.get("user") or ("" if r.ancestor else fmt.NA)), dim))
            elif k == "command":
                text = str(p.get("name") or "?") if narrow or r.ancestor else pv.command(p)
                cell = Text(branch, "dim")
                cell.append(text, "bold red" if foreign else ("bold" if role == "engine" else dim))
                out.append(cell)
            elif r.ancestor:
                out.append("")
            else:
                value = {"gpu_mem": fmt.bytes_h(p.get("gpu_memory_bytes")), "sm": pv.sm(p), "cpu": pv.cpu(p),
                         "rss": fmt.bytes_h(p.get("rss_bytes")), "time": pv.elapsed(p, self.now)}[k]
                out.append(Text(value, justify="right"))
        return out
