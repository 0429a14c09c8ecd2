"""The help screen (`?`)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("q", "quit"),
    ("?", "this help (Esc closes it)"),
    ("p", "pause / resume polling: the screen freezes so you can read it"),
    ("/", "filter the processes: user:NAME gpu:N engine:NAME role:ROLE (or foreign), any other word "
          "anywhere in pid, name, command line, user, unit, role, why; Esc clears"),
    ("s / S", "sort the processes by the next / previous column; figures largest first"),
    ("r", "reverse the sort"),
    ("t", "process tree: each process under its parent (a parent holding no GPU shown dim)"),
    ("f", "foreign processes only"),
    ("g", "the processes of one GPU, each in turn, then all"),
    ("e / E", "the next / previous engine in the Engine panel, its GPUs highlighted (several engines)"),
    ("h", "history: the daemon's last hour of GPU and engine figures; +/- zoom"),
    ("Enter", "details of the selected process or alert"),
    ("k", "signal the selected foreign process (TERM or KILL), after a confirmation; "
          "only when the daemon allows write actions ([daemon] allow_write_actions = true)"),
    ("Tab", "move between the processes table and the alert feed"),
]

PANELS = [
    ("Host · preflight", "the last preflight: counts, then each failing, erroring or warning check with its evidence and fix"),
    ("GPU n", "utilization, memory, temperature, power (sparklines of the last minutes, newest at the right), "
              "clocks, active throttle reasons (red: HW/thermal/power brake), PCIe replays, ECC, XIDs"),
    ("Engine", "requests running/waiting, KV pages used, output tokens/s, TTFT and ITL p50 and p99 over the last minute; "
               "the sparklines show p99 over time"),
    ("GPU processes", "⚠ foreign (⚠ agent: a known monitoring agent), ★ the engine (its name with several), "
                      "◆ zerod, ✓ allowed by the config; GPU memory, SM %, host CPU %, RSS, elapsed, command"),
    ("Alerts", "newest first; firing ones in red, resolved ones kept for an hour"),
]


def help_text(socket_path: str, interval: float, write_actions: bool | None) -> Group:
    keys = Table.grid(padding=(0, 2))
    keys.add_column(style="bold cyan", no_wrap=True)
    keys.add_column(ratio=1)
    for k, what in KEYS:
        keys.add_row(Text(k), Text(what))
    panels = Table.grid(padding=(0, 2))
    panels.add_column(style="bold", no_wrap=True)
    panels.add_column(ratio=1)
    for name, what in PANELS:
        panels.add_row(Text(name), Text(what))
    wa = "unknown" if write_actions is None else ("allowed" if write_actions else "disabled")
    daemon = Text(f"control socket {socket_path}, polled every {interval:g}s\nwrite actions: {wa}")
    return Group(Text("Keys", "bold underline"), keys, Text(""), Text("Panels", "bold underline"), panels,
                 Text(""), Text("Daemon", "bold underline"), daemon)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False),
                Binding("q", "dismiss", "Close", show=False)]

    def __init__(self, text: Group) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box", classes="dialog") as box:
            box.border_title = "zerod top · help"
            box.border_subtitle = "Esc to close"
            yield Static(self._text, id="help-text")

    def action_dismiss(self, result=None) -> None:  # type: ignore[override]
        self.dismiss(None)
