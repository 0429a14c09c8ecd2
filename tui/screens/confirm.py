"""The confirmation before signalling a foreign process (`k`)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from zerod.tui import format as fmt


def question(proc: dict[str, Any]) -> Text:
    t = Text()
    t.append("Send a signal to ")
    t.append(f"{proc.get('name') or '?'} (pid {proc.get('pid')})", "bold red")
    t.append("?\n\n")
    for label, key in (("user", "user"), ("unit", "unit"), ("container", "container"),
                       ("GPU memory", "gpu_memory_bytes"), ("command", "cmdline")):
        v = proc.get(key)
        if v is None:
            continue
        t.append(f"{label}: ", "bold")
        t.append(f"{fmt.bytes_h(v) if key == 'gpu_memory_bytes' else v}\n")
    if proc.get("why"):
        t.append("why foreign: ", "bold")
        t.append(f"{proc['why']}\n")
    if proc.get("fix"):
        t.append("\nThe lasting fix: ", "bold")
        t.append(f"{proc['fix']}\n", "cyan")
    t.append("\nA unit or container may restart it; the daemon re-checks the pid before signalling.", "dim")
    return t


class ConfirmSignalScreen(ModalScreen[str | None]):
    """Dismisses with "TERM", "KILL" or None (cancel)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("n", "cancel", "Cancel", show=False),
                Binding("t", "send('TERM')", "SIGTERM"), Binding("y", "send('TERM')", "SIGTERM", show=False),
                Binding("K", "send('KILL')", "SIGKILL")]

    def __init__(self, proc: dict[str, Any]) -> None:
        super().__init__()
        self.proc = proc

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="dialog") as box:
            box.border_title = escape(f"Signal {self.proc.get('name') or '?'} (pid {self.proc.get('pid')})?")
            yield Static(question(self.proc), id="confirm-text")
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel", id="cancel", variant="primary")
                yield Button("SIGTERM (t)", id="term", variant="warning")
                yield Button("SIGKILL (K)", id="kill", variant="error")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss({"term": "TERM", "kill": "KILL"}.get(event.button.id or ""))

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_send(self, sig: str) -> None:
        self.dismiss(sig)
