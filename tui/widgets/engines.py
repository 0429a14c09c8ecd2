"""Several engines ([[engines]]): one line each — name, GPUs, state, restarts,
pid, model, address. Hidden with one engine (the Engine panel says it all);
the Engine panel shows the one marked ▶ (`e` moves it)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical

from zerod.tui.widgets.line import Line, set_title
from zerod.tui.widgets.statusbar import ENGINE_STYLE


def engine_line(e: dict[str, Any], narrow: bool, chosen: bool = False) -> Text:
    state = e.get("state") or "?"
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("▶" if chosen else " ", "bold")  # the engine the Engine panel shows
    t.append("● ", ENGINE_STYLE.get(state, "bold"))
    t.append(f"{e.get('name', '?'):<10}", "bold")
    t.append(" GPU ", "dim")
    t.append(f"{','.join(map(str, e.get('gpus') or [])) or '?':<8}")
    t.append(f" {state:<10}", ENGINE_STYLE.get(state, "bold"))
    restarts = e.get("restarts") or 0
    t.append(f" {restarts} restarts", "bold yellow" if restarts else "dim")
    if not narrow and e.get("pid"):
        t.append(f" · pid {e['pid']}")
    if e.get("model"):
        t.append(f" · {e['model']}")
    if not narrow and e.get("url"):
        t.append(f" · {e['url'].removeprefix('http://')}", "dim")
    return t


class EngineList(Vertical):
    def compose(self) -> ComposeResult:
        return iter(())

    def show(self, status: dict[str, Any], narrow: bool, chosen: str | None = None) -> None:
        engines = [e for e in (status.get("engines") or []) if isinstance(e, dict)]
        # below 32 rows the processes need the lines: the Engine panel's title says which engine it shows
        self.display = len(engines) > 1 and self.app.size.height >= 32
        if not self.display:
            return
        rows = list(self.query(Line))
        if len(rows) != len(engines):
            for r in rows:
                r.remove()
            rows = [Line("", classes="engine-line") for _ in engines]
            self.mount_all(rows)
        up = sum(1 for e in engines if e.get("state") == "healthy")
        set_title(self, f"Engines ({len(engines)}) · {up} healthy · e: show the next in the Engine panel")
        self.set_class(up < len(engines), "-alarm")
        for row, e in zip(rows, engines):
            row.set(engine_line(e, narrow, e.get("name") == chosen))
