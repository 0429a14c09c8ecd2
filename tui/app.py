"""`zerod top`: the live dashboard, a client of the daemon's control API.

Polling runs in thread workers (the client is blocking http.client over the Unix
socket) that hand each result back to the UI thread with `call_from_thread`; the UI
thread never waits on the daemon. A poll that fails shows a banner and the next tick
retries; the last good data stays on screen, marked stale.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.markup import escape
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Input

from zerod.tui.client import DEFAULT_SOCKET, ControlClient, ControlError, DaemonUnreachable, Snapshot
from zerod.tui.screens.confirm import ConfirmSignalScreen
from zerod.tui.screens.details import ALERT_FIELDS, PROCESS_FIELDS, DetailsScreen
from zerod.tui.screens.help import HelpScreen, help_text
from zerod.tui.screens.history import HistoryScreen
from zerod.tui.widgets.alerts import AlertTable
from zerod.tui.widgets.banner import START_HINT, Banner, banner_text, standalone_text
from zerod.tui.widgets.engine import EnginePanel
from zerod.tui.widgets.engines import EngineList
from zerod.tui.widgets.gpu import GpuList, grid_fits
from zerod.tui.widgets.line import set_title
from zerod.tui.widgets.preflight import PreflightPanel
from zerod.tui.widgets.processes import FilterInput, ProcessTable
from zerod.tui.widgets.statusbar import StatusBar, status_line

NARROW_BELOW = 100  # columns


class ZerodTop(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "zerod top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_BELOW, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    ENABLE_COMMAND_PALETTE = False

    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "toggle_pause", "Pause"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("s", "sort(1)", "Sort"),
        Binding("S", "sort(-1)", "Sort back", show=False),
        Binding("r", "reverse", "Reverse", show=False),
        Binding("t", "tree", "Tree"),
        Binding("f", "foreign_only", "Foreign"),
        Binding("g", "gpu_filter", "GPU", show=False),
        Binding("e", "engine(1)", "Engine"),
        Binding("E", "engine(-1)", "Engine back", show=False),
        Binding("h", "history", "History"),
        Binding("k", "signal", "Signal"),
    ]

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, interval: float = 1.0,
                 timeout: float = 2.0, clock: Callable[[], float] = time.time,
                 local: Callable[[float], Snapshot] | None = None,
                 start_hint: str = START_HINT) -> None:
        """`local`: standalone mode, a reader of this host used while the daemon cannot
        be reached (tui/local_source.py); None keeps the last data on screen instead."""
        super().__init__()
        self.socket_path = socket_path
        self.interval = interval
        self.clock = clock
        self.local = local
        self.start_hint = start_hint
        self.source = "daemon"  # where the data on screen comes from: "daemon" or "local"
        self.engine_name: str | None = None  # the engine the Engine panel shows (None: the first)
        self.client = ControlClient(socket_path, timeout=timeout)
        self.snapshot: Snapshot | None = None
        self.last_ok: float | None = None
        self.error: str | None = None
        self.down_since: float | None = None
        self.paused = False
        self.polls = 0          # answered polls (ok or failed), for tests and the screenshot script
        self._in_flight = False

    # ---------------------------------------------------------------- layout
    def compose(self) -> ComposeResult:
        yield StatusBar(id="statusbar")
        yield Banner(id="banner")
        with Vertical(id="main"):
            with Horizontal(id="top"):
                yield PreflightPanel(id="preflight", classes="panel")
                yield EnginePanel(id="engine", classes="panel")
            yield EngineList(id="engines", classes="panel")
            yield GpuList(id="gpus")
            with Horizontal(id="bottom"):
                with Vertical(id="processes", classes="panel"):
                    yield FilterInput(placeholder="filter processes (Esc clears)", id="filter")
                    yield ProcessTable(id="process-table")
                with Vertical(id="alerts", classes="panel"):
                    yield AlertTable(id="alert-table")
        yield Footer()

    def on_mount(self) -> None:
        self.main.query_one("#preflight").border_title = "Host · preflight"
        self.main.query_one("#engine").border_title = "Engine"
        self.main.query_one("#processes").border_title = "GPU processes"
        self.main.query_one("#alerts").border_title = "Alerts"
        self.main.query_one("#filter").display = False
        self.main.query_one("#banner").display = False
        self.main.query_one("#engines").display = False
        self.main.query_one(ProcessTable).focus()
        self._render_status()
        self.set_interval(self.interval, self._tick)
        self._tick()

    @property
    def main(self):
        """The dashboard's screen (the bottom of the stack), also while a dialog is open."""
        return self.screen_stack[0]

    @property
    def narrow(self) -> bool:
        return self.size.width < NARROW_BELOW

    def on_resize(self) -> None:
        if self.snapshot is not None:
            self._render(self.snapshot)
        self._render_status()

    # ---------------------------------------------------------------- polling
    def _tick(self) -> None:
        if not self._render_status():  # the app is closing
            return
        if self.paused or self._in_flight:
            return
        self._in_flight = True
        self._poll()

    def poll_now(self) -> None:
        """Poll at once (after a signal, on resume) unless a poll is under way."""
        if not self._in_flight:
            self._in_flight = True
            self._poll()

    @work(thread=True, exit_on_error=False, group="poll")
    def _poll(self) -> None:
        try:
            snap = self.client.snapshot(now=self.clock())
        except DaemonUnreachable as exc:
            if self.local is None:
                self._hand_back(self._poll_failed, str(exc))
                return
            try:
                local = self.local(self.clock())
            except Exception as lexc:  # the host cannot be read either: the daemon's banner
                self._hand_back(self._poll_failed, f"{exc}; reading this host failed: {type(lexc).__name__}: {lexc}")
            else:
                self._hand_back(self._poll_local, (local, str(exc)))
        except ControlError as exc:
            self._hand_back(self._poll_failed, str(exc))
        except Exception as exc:  # anything else the daemon's answer provoked
            self._hand_back(self._poll_failed, f"{type(exc).__name__}: {exc}")
        else:
            self._hand_back(self._poll_ok, snap)

    def _hand_back(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self.call_from_thread(fn, arg)
        except Exception:  # the app is closing: nothing to show it on
            self._in_flight = False

    def _poll_ok(self, snap: Snapshot) -> None:
        self._in_flight = False
        if not self._mounted():
            return
        self.polls += 1
        if self.paused:
            return
        self.snapshot = snap
        try:
            self._render(snap)
        except Exception as exc:  # an answer in a shape the panels cannot show
            self._poll_failed(f"cannot show the daemon's answer: {type(exc).__name__}: {exc}", counted=True)
            return
        self.last_ok = snap.taken_at
        self.error = None
        self.down_since = None
        self.source = "daemon"
        self.main.query_one("#banner").display = False
        self.main.query_one("#main").remove_class("-stale")
        self._render_status()
        self._bindings_changed()

    def _poll_failed(self, message: str, counted: bool = False) -> None:
        self._in_flight = False
        if not self._mounted():
            return
        if not counted:
            self.polls += 1
        now = self.clock()
        if self.error is None or self.down_since is None:
            self.down_since = now
        self.error = message
        banner = self.main.query_one(Banner)
        banner.set(banner_text(self.socket_path, message, now=now, down_since=self.down_since,
                               last_ok=self.last_ok, interval=self.interval), layout=True)
        banner.display = True
        self.main.query_one("#main").set_class(self.snapshot is not None, "-stale")
        self._render_status()
        self._bindings_changed()

    def _poll_local(self, result: tuple[Snapshot, str]) -> None:
        """Standalone mode: no daemon, this host read directly, a banner saying so."""
        self._in_flight = False
        if not self._mounted():
            return
        self.polls += 1
        if self.paused:
            return
        snap, message = result
        now = self.clock()
        if self.error is None or self.down_since is None:
            self.down_since = now
        self.error = message
        self.source = "local"
        self.snapshot = snap
        try:
            self._render(snap)
        except Exception as exc:
            self._poll_failed(f"cannot show this host's data: {type(exc).__name__}: {exc}", counted=True)
            return
        nvml = snap.gpus.get("nvml") or {}
        banner = self.main.query_one(Banner)
        banner.set(standalone_text(self.socket_path, message, nvml_error=None if nvml.get("ok") else nvml.get("error"),
                                   report_at=snap.checks.get("taken_at"), now=now, start_hint=self.start_hint),
                   layout=True)
        banner.display = True
        self.main.query_one("#main").remove_class("-stale")
        self._render_status()
        self._bindings_changed()

    def _bindings_changed(self) -> None:
        """Refresh the footer only when what it shows changes (k comes and goes)."""
        shown = (self.write_actions, self.several_engines)
        if shown != getattr(self, "_shown_bindings", None):
            self._shown_bindings = shown
            self.refresh_bindings()

    # ---------------------------------------------------------------- rendering
    def _render(self, snap: Snapshot) -> None:
        now = self.clock()
        narrow = self.narrow
        self.main.query_one(PreflightPanel).show(snap.status, snap.checks, snap.gpus, now=now, narrow=narrow)
        chosen = self.chosen_engine(snap)
        docs = snap.engine_docs()
        if len(docs) > 1:
            chosen = {**chosen, "of": f"{docs.index(chosen) + 1}/{len(docs)}"}
        self.main.query_one(EnginePanel).show({**snap.status, "engine": chosen}, chosen, snap.alerts, narrow)
        self.main.query_one(EngineList).show(snap.status, narrow, chosen.get("name"))
        gpus_of = {g for g in (chosen.get("gpus") or []) if isinstance(g, int)} if len(docs) > 1 else set()
        n_gpus = len([g for g in (snap.gpus.get("gpus") or []) if isinstance(g, dict)])
        self.main.set_class(grid_fits(n_gpus, self.size.width, self.size.height), "-gpu-grid")
        self.main.query_one(GpuList).show(snap.gpus, narrow, gpus_of)
        self._render_processes(snap)
        alerts = [a for a in (snap.alerts.get("alerts") or []) if isinstance(a, dict)]
        self.main.query_one(AlertTable).show(alerts, now, narrow)
        firing = sum(1 for a in alerts if a.get("state") == "firing")
        set_title(self.main.query_one("#alerts"), (
            f"Alerts · [bold red]{firing} firing[/] · {len(alerts) - firing} resolved" if firing
            else f"Alerts · none firing · {len(alerts)} resolved"))
        if snap.errors:
            self.notify("; ".join(f"{k}: {v}" for k, v in snap.errors.items()),
                        title="The daemon answered with errors", severity="warning", timeout=4)

    def _render_processes(self, snap: Snapshot) -> None:
        procs = [p for p in (snap.processes.get("processes") or []) if isinstance(p, dict)]
        table = self.main.query_one(ProcessTable)
        shown = table.show(procs, self.narrow, self.clock(), len(snap.engine_docs()) > 1)
        foreign = sum(1 for p in procs if p.get("role") == "foreign")
        title = f"GPU processes ({len(procs)})"
        if foreign:
            title += f" · [bold red]{foreign} foreign[/]"
        title += f" · {table.describe()}"
        keep = table.current_filter()
        if keep.active:
            title += f" · filter '{escape(keep.describe())}': {len(shown)} shown"
        set_title(self.main.query_one("#processes"), title)

    def chosen_engine(self, snap: Snapshot) -> dict[str, Any]:
        """The engine the Engine panel shows: the one `e` picked, else the first."""
        docs = snap.engine_docs()
        for d in docs:
            if d.get("name") == self.engine_name:
                return d
        return docs[0] if docs else {}

    def _mounted(self) -> bool:
        """False while the app is closing and its widgets are going away."""
        try:
            self.main.query_one(StatusBar)
        except (NoMatches, IndexError):
            return False
        return True

    def _render_status(self) -> bool:
        snap = self.snapshot
        try:
            bar = self.main.query_one(StatusBar)
        except (NoMatches, IndexError):
            return False
        bar.set(status_line(
            snap.status if snap else {}, snap.alerts if snap else {}, now=self.clock(),
            taken_at=self.last_ok, paused=self.paused, unreachable=self.error is not None,
            narrow=self.narrow))
        return True

    # ---------------------------------------------------------------- actions
    @property
    def write_actions(self) -> bool:
        return bool(self.snapshot and self.error is None and self.snapshot.status.get("write_actions"))

    @property
    def several_engines(self) -> bool:
        return bool(self.snapshot and len(self.snapshot.engine_docs()) > 1)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "signal":
            return self.write_actions  # hidden from the footer and inert unless the daemon allows it
        if action == "engine":
            return self.several_engines  # one engine: the panel shows it already
        return True

    # the process table's view: sort, direction, tree, foreign only, one GPU
    def _processes_changed(self) -> None:
        if self.snapshot is not None:
            self._render_processes(self.snapshot)

    def action_sort(self, step: int) -> None:
        table = self.main.query_one(ProcessTable)
        table.cycle_sort(step)
        self._processes_changed()

    def action_reverse(self) -> None:
        table = self.main.query_one(ProcessTable)
        table.sort_flipped = not table.sort_flipped
        self._processes_changed()

    def action_tree(self) -> None:
        table = self.main.query_one(ProcessTable)
        table.as_tree = not table.as_tree
        self._processes_changed()

    def action_foreign_only(self) -> None:
        table = self.main.query_one(ProcessTable)
        table.foreign_only = not table.foreign_only
        self._processes_changed()

    def action_gpu_filter(self) -> None:
        """All GPUs, then each GPU in turn, then all again."""
        table = self.main.query_one(ProcessTable)
        indices = sorted({g.get("index") for g in (self.snapshot.gpus.get("gpus") or [])
                          if isinstance(g, dict) and isinstance(g.get("index"), int)}) if self.snapshot else []
        if not indices:
            table.gpu = None
        elif table.gpu is None or table.gpu not in indices:
            table.gpu = indices[0]
        else:
            i = indices.index(table.gpu) + 1
            table.gpu = indices[i] if i < len(indices) else None
        self._processes_changed()

    def action_engine(self, step: int) -> None:
        if self.snapshot is None:
            return
        docs = self.snapshot.engine_docs()
        if len(docs) < 2:
            return
        names = [d.get("name") for d in docs]
        at = names.index(self.engine_name) if self.engine_name in names else 0
        self.engine_name = names[(at + step) % len(names)]
        self._render(self.snapshot)

    def action_history(self) -> None:
        engine = self.chosen_engine(self.snapshot).get("name") if self.snapshot else None
        self.push_screen(HistoryScreen(self.client, interval=self.interval, engine=engine,
                                       standalone=self.source == "local"))

    def action_help(self) -> None:
        wa = None if self.snapshot is None else bool(self.snapshot.status.get("write_actions"))
        self.push_screen(HelpScreen(help_text(self.socket_path, self.interval, wa)))

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._render_status()
        if not self.paused:
            self.poll_now()

    def action_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_close_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = bool(box.value)
        self.main.query_one(ProcessTable).focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.main.query_one(ProcessTable).filter = event.value
        self._processes_changed()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.action_close_filter()

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        now = self.clock()
        key = event.row_key.value
        if isinstance(event.data_table, ProcessTable):
            proc = event.data_table.process(key)
            if proc is not None:
                self.push_screen(DetailsScreen(f"Process {proc.get('name') or '?'} (pid {proc.get('pid')})",
                                               proc, PROCESS_FIELDS, now))
        elif isinstance(event.data_table, AlertTable):
            alert = event.data_table.alert(key)
            if alert is not None:
                self.push_screen(DetailsScreen(f"Alert {alert.get('alertname') or '?'} ({alert.get('state')})",
                                               alert, ALERT_FIELDS, now))

    def action_signal(self) -> None:
        if not self.write_actions:
            return
        proc = self.main.query_one(ProcessTable).selected()
        if proc is None:
            self.notify("Select a process in the GPU processes table first.", severity="warning")
            return
        if proc.get("role") != "foreign":
            self.notify(f"{proc.get('name')} (pid {proc.get('pid')}) is {proc.get('role')}, not foreign: "
                        "zerod top signals foreign processes only.", severity="warning")
            return

        def confirmed(sig: str | None) -> None:
            if sig:
                self._send_signal(proc, sig)

        self.push_screen(ConfirmSignalScreen(proc), confirmed)

    @work(thread=True, exit_on_error=False, group="signal")
    def _send_signal(self, proc: dict[str, Any], sig: str) -> None:
        what = f"{proc.get('name')} (pid {proc.get('pid')})"
        try:
            self.client.signal(int(proc["pid"]), sig)
        except (ControlError, ValueError, KeyError, TypeError) as exc:
            self._hand_back_notify(f"SIG{sig} to {what} failed: {exc}", "error")
        else:
            self._hand_back_notify(f"Sent SIG{sig} to {what}.", "information")
        try:
            self.call_from_thread(self.poll_now)
        except Exception:
            pass

    def _hand_back_notify(self, message: str, severity: str) -> None:
        try:
            self.call_from_thread(self.notify, message, severity=severity, timeout=6)
        except Exception:
            pass


def run(socket_path: str = DEFAULT_SOCKET, interval: float = 1.0,
        local: Callable[[float], Snapshot] | None = None) -> None:
    ZerodTop(socket_path, interval=interval, local=local).run()
