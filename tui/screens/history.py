"""The history screen (`h`): the daemon's last hour (GET /v1/history) of every GPU's
utilization, memory, power and temperature and the chosen engine's throughput and
ITL p99, one sparkline per series across the screen, zoomable from a minute to the
hour. The daemon buckets the samples by max to the width, so a spike stays visible."""

from __future__ import annotations

from typing import Any, Sequence

from rich.style import Style
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from zerod.tui import format as fmt
from zerod.tui.client import ControlClient, ControlError
from zerod.tui.widgets.spark import BARS, levels

WINDOWS = (60.0, 300.0, 600.0, 1800.0, 3600.0)  # the zoom steps, seconds
LABEL, VALUE = 8, 32                      # columns beside the sparkline
# (series, title, low bound, high bound or the key of a GPU's bound, how to show one value)
GPU_SERIES = (
    ("utilization_ratio", "GPU utilization", 0.0, 1.0, fmt.pct),
    ("memory_used_bytes", "GPU memory used", 0.0, None, lambda v: f"{fmt.gib(v)} GiB"),
    ("power_watts", "GPU power", 0.0, None, lambda v: f"{v:.0f} W"),
    ("temperature_celsius", "GPU temperature", None, None, lambda v: f"{v:.0f} °C"),
)
ENGINE_SERIES = (
    ("output_tokens_per_s", "output tokens/s", 0.0, None, fmt.rate),
    ("itl_p99_s", "ITL p99", 0.0, None, fmt.ms),
)


def spark_text(values: Sequence[Any], lo: float | None, hi: float | None) -> Text:
    """A sparkline of `values`, a gap (space) where a bucket has no sample."""
    have = [float(v) for v in values if fmt.num(v) is not None]
    lv = iter(levels(have, lo, hi))
    t = Text(no_wrap=True, overflow="crop")
    for v in values:
        if fmt.num(v) is None:
            t.append(" ")
        else:
            level = next(lv)
            t.append(BARS[level], Style(color="bright_cyan" if level >= 5 else "cyan"))
    return t


def _row(label: str, values: Sequence[Any], lo, hi, show, width: int) -> Text:
    values = list(values)[-width:]  # more points than columns: the newest stay
    have = [float(v) for v in values if fmt.num(v) is not None]
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{label:<{LABEL}}", "bold")
    t.append_text(spark_text(values, lo, hi))
    if have:
        t.append(f"  now {show(have[-1])}", "bold")
        t.append(f"  max {show(max(have))}", "dim")
    else:
        t.append("  no samples", "dim")
    return t


def history_text(doc: dict[str, Any], engine: str | None, width: int) -> Text:
    """Every series of the /v1/history document, `width` bars at most each."""
    t = Text(no_wrap=True, overflow="crop")
    step = fmt.num(doc.get("step_s")) or 0.0
    t.append(f"last {fmt.duration(doc.get('seconds'))}", "bold")
    t.append(f" · one bar per {step:g}s (the largest sample in it) · the daemon samples every "
             f"{fmt.num(doc.get('interval_s')) or 0:g}s and keeps {fmt.duration(doc.get('keep_s'))}", "dim")
    gpus = [g for g in (doc.get("gpus") or []) if isinstance(g, dict)]
    for key, title, lo, hi, show in GPU_SERIES:
        t.append(f"\n\n{title}\n", "bold underline")
        if not gpus:
            t.append("no GPU samples", "dim")
        rows = []
        for g in gpus:
            values = (g.get("series") or {}).get(key) or []
            rows.append(_row(f"GPU {g.get('index')}", values, lo, hi, show, width))
        t.append_text(Text("\n").join(rows))
    for e in (x for x in (doc.get("engines") or []) if isinstance(x, dict)):
        if engine is not None and e.get("name") != engine:
            continue
        for key, title, lo, hi, show in ENGINE_SERIES:
            t.append(f"\n\nengine {e.get('name')} · {title}\n", "bold underline")
            t.append_text(_row("", (e.get("series") or {}).get(key) or [], lo, hi, show, width))
    return t


class HistoryScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("h", "dismiss", "Close", show=False),
                Binding("q", "dismiss", "Close", show=False),
                Binding("plus,equals_sign", "zoom(-1)", "Zoom in", key_display="+"),
                Binding("minus", "zoom(1)", "Zoom out", key_display="-")]

    def __init__(self, client: ControlClient, *, interval: float, engine: str | None,
                 standalone: bool = False, window: float = 600.0) -> None:
        super().__init__()
        self.client = client
        self.interval = interval
        self.engine = engine
        self.standalone = standalone
        self.window = min(WINDOWS, key=lambda w: abs(w - window))
        self.doc: dict[str, Any] | None = None
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="history-box", classes="dialog") as box:
            box.border_title = "zerod top · history"
            box.border_subtitle = "+/- zoom · Esc to close"
            yield Static("reading the daemon's history…", id="history-text")

    def on_mount(self) -> None:
        if self.standalone:
            self._show(Text("The history is kept by the daemon, and it is not running: start it and "
                            "the last hour fills from then on.", "bold yellow"))
            return
        self._fetch()
        self.set_interval(max(self.interval, 1.0), self._fetch)

    def _points(self) -> int:
        return max(10, self.app.size.width - LABEL - VALUE - 12)

    @work(thread=True, exit_on_error=False, group="history", exclusive=True)
    def _fetch(self) -> None:
        try:
            doc = self.client.history(self.window, self._points(), self.engine)
        except ControlError as exc:
            self._hand_back(None, str(exc))
        else:
            self._hand_back(doc, None)

    def _hand_back(self, doc: dict[str, Any] | None, error: str | None) -> None:
        try:
            self.app.call_from_thread(self._got, doc, error)
        except Exception:  # closing
            pass

    def _got(self, doc: dict[str, Any] | None, error: str | None) -> None:
        self.doc, self.error = doc, error
        if doc is not None:
            self._show(history_text(doc, self.engine, self._points()))
        else:
            self._show(Text(f"cannot read the daemon's history: {error}", "bold red"))

    def _show(self, text: Text) -> None:
        try:
            self.query_one("#history-text", Static).update(text)
        except Exception:
            pass

    def action_zoom(self, step: int) -> None:
        i = max(0, min(len(WINDOWS) - 1, WINDOWS.index(self.window) + step))
        if WINDOWS[i] != self.window:
            self.window = WINDOWS[i]
            if not self.standalone:
                self._fetch()

    def action_dismiss(self, result=None) -> None:  # type: ignore[override]
        self.dismiss(None)
