"""The help screen (`?`)."""

from __future__ import annotations

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
    ("/", "filter the processes table (pid, name, command line, user, unit, role); Esc clears"),
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
    ("GPU processes", "★ the engine, ◆ this daemon, ✓ allowed by the config, ⚠ foreign: anything else holding the GPU, with why"),
    ("Alerts", "newest first; firing ones in red, resolved ones kept for an hour"),
]


def help_text(socket_path: str, interval: float, write_actions: bool | None) -> Text:
    t = Text()
    t.append("Keys\n", "bold underline")
    for k, what in KEYS:
        t.append(f"  {k:<6}", "bold cyan")
        t.append(f"{what}\n")
    t.append("\nPanels\n", "bold underline")
    for name, what in PANELS:
        t.append(f"  {name}: ", "bold")
        t.append(f"{what}\n")
    t.append("\nDaemon\n", "bold underline")
    t.append(f"  control socket {socket_path}, polled every {interval:g}s\n")
    wa = "unknown" if write_actions is None else ("allowed" if write_actions else "disabled")
    t.append(f"  write actions: {wa}\n")
    return t


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("question_mark", "dismiss", "Close", show=False),
                Binding("q", "dismiss", "Close", show=False)]

    def __init__(self, text: Text) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box", classes="dialog") as box:
            box.border_title = "zerod top · help"
            box.border_subtitle = "Esc to close"
            yield Static(self._text, id="help-text")

    def action_dismiss(self, result=None) -> None:  # type: ignore[override]
        self.dismiss(None)
