"""Column widths for a DataTable that fills its width: every column as wide as its
content except one flexible column that takes the rest (cropped with an ellipsis)."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text

PAD = 2  # DataTable's cell_padding (1) on both sides


def cell_len(cell: Text | str) -> int:
    return cell.cell_len if isinstance(cell, Text) else Text(str(cell)).cell_len


def widths(labels: Sequence[str], rows: Sequence[Sequence[Text | str]], flex: int, avail: int,
           flex_min: int = 12) -> list[int]:
    ws = [max([len(lab)] + [cell_len(r[i]) for r in rows]) for i, lab in enumerate(labels)]
    fixed = sum(w + PAD for i, w in enumerate(ws) if i != flex)
    ws[flex] = max(flex_min, min(ws[flex], avail - fixed - PAD))
    return ws


def crop(cell: Text | str) -> Text:
    t = cell.copy() if isinstance(cell, Text) else Text(str(cell))
    t.no_wrap = True
    t.overflow = "ellipsis"
    return t


def refill(table, labels: Sequence[str], ws: Sequence[int],
           keyed_rows: Sequence[tuple[str, Sequence[Text | str]]]) -> None:
    """Rebuild a DataTable's columns and rows, the cursor staying on the same row key.
    A repeated key (a daemon bug) gets a suffix instead of crashing the dashboard."""
    keep = None
    if table.row_count:
        try:
            keep = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except Exception:
            keep = None
    table.clear(columns=True)
    for label, w in zip(labels, ws):
        table.add_column(label, width=w)
    keys: list[str] = []
    for k, cells in keyed_rows:
        if k in keys:
            k = f"{k}#{len(keys)}"
        keys.append(k)
        table.add_row(*map(crop, cells), key=k)
    if keep in keys:
        table.move_cursor(row=keys.index(keep), animate=False)
