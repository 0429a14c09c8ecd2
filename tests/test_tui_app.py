"""`zerod top` driven with Textual's Pilot against a little daemon serving the recorded
control-API data over a Unix socket (tests/tui_fake_daemon.py)."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import socket
import tempfile
import time

import pytest
from click.testing import CliRunner
from rich.console import Console

from tui_fake_daemon import NOW, FakeDaemon
from zerod.tui.app import ZerodTop
from zerod.tui.screens.confirm import ConfirmSignalScreen
from zerod.tui.screens.details import DetailsScreen
from zerod.tui.screens.help import HelpScreen
from zerod.tui.widgets.alerts import AlertTable
from zerod.tui.widgets.banner import Banner
from zerod.tui.widgets.engine import EnginePanel
from zerod.tui.widgets.processes import ProcessTable
from zerod.tui.widgets.statusbar import StatusBar

SIZE = (120, 40)


@pytest.fixture
def sock_path():
    d = tempfile.mkdtemp(prefix="zt")  # short: AF_UNIX paths are limited to 107 bytes
    yield os.path.join(d, "control.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(sock_path):
    fake = FakeDaemon(sock_path).start()
    yield fake
    fake.stop()


def make_app(path: str, **kw) -> ZerodTop:
    kw.setdefault("interval", 0.3)
    kw.setdefault("timeout", 1.0)
    return ZerodTop(path, clock=lambda: NOW, **kw)


async def until(pilot, cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)
    await pilot.pause()


def text_of(widget) -> str:
    return str(widget.render())


def rows(table) -> list[str]:
    return [str(k.value) for k in table.rows]


async def test_shows_the_recorded_data(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        assert "gpu-h200-07" in text_of(app.query_one(StatusBar))
        assert "2 firing" in text_of(app.query_one(StatusBar))
        procs = app.query_one(ProcessTable)
        assert rows(procs) == ["2211", "48211", "48190", "1312"]  # foreign first, then the engine
        assert str(procs.get_row("2211")[2]) == "⚠ agent" and "engine" in str(procs.get_row("48211")[2])
        alerts = app.query_one(AlertTable)
        assert rows(alerts) == ["LatencyRegression/itl", "ForeignGpuProcess/2211", "ForeignGpuProcess/1877"]
        assert "firing" in str(alerts.get_row("LatencyRegression/itl")[0])
        assert "resolved" in str(alerts.get_row("ForeignGpuProcess/1877")[0])
        assert not app.query_one(Banner).display
        # the footer offers no `k` while the daemon allows no write actions
        assert app.check_action("signal", ()) is False


async def test_help_opens_and_closes(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(app.screen._text)
        shown = console.export_text()
        assert "filter the processes: user:NAME" in shown and "process tree" in shown and daemon.socket_path in shown
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_pause_freezes_and_resume_catches_up(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("p")
        assert app.paused and "PAUSED" in text_of(app.query_one(StatusBar))
        engine = dict(daemon.data["engine"], running=7, waiting=0)
        daemon.update("engine", engine)
        gets = daemon.gets
        await pilot.pause(0.4)  # four poll intervals
        assert daemon.gets == gets, "a paused dashboard does not poll"
        assert app.snapshot.engine["running"] == 193
        await pilot.press("p")
        await until(pilot, lambda: app.snapshot.engine["running"] == 7)
        assert not app.paused and "PAUSED" not in text_of(app.query_one(StatusBar))
        reqs = app.query_one(EnginePanel).query_one(".m-reqs .metric-value")
        assert str(reqs.render()).startswith("7 run")


async def test_filter_processes(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ProcessTable)
        await pilot.press("slash")
        assert app.focused.id == "filter"
        await pilot.press(*"dcgm")
        assert rows(table) == ["2211"]
        assert "filter 'dcgm': 1 shown" in str(app.query_one("#processes").border_title)
        await pilot.press("escape")  # clears
        assert rows(table) == ["2211", "48211", "48190", "1312"] and app.focused is table
        await pilot.press("slash", *"zerod.service", "enter")  # kept after Enter
        assert rows(table) == ["48211", "48190"] and app.focused is table
        assert app.query_one("#filter").display
        # `q` typed in the filter is text, not quit
        await pilot.press("slash", "q")
        assert app.is_running and app.query_one("#filter").value.endswith("q")


async def test_details_of_a_process_and_an_alert(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("enter")  # the processes table has the focus, first row: the foreign one
        assert isinstance(app.screen, DetailsScreen)
        body = str(app.screen.query_one("#details-text").render())
        assert "pid 2211" in app.screen.query_one("#details-box").border_title
        assert "systemctl stop dcgm-exporter" in str(app.screen._item.get("fix"))
        await pilot.press("escape")
        assert not isinstance(app.screen, DetailsScreen)
        await pilot.press("down", "enter")  # the engine
        assert isinstance(app.screen, DetailsScreen) and app.screen._item["pid"] == 48211
        await pilot.press("escape", "tab")
        assert isinstance(app.focused, AlertTable)
        await pilot.press("enter")
        assert isinstance(app.screen, DetailsScreen)
        assert app.screen._item["alertname"] == "LatencyRegression"
        assert "LatencyRegression" in app.screen.query_one("#details-box").border_title
        del body


async def test_signal_not_offered_without_write_actions(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("k")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmSignalScreen)
        assert daemon.posts == []
        keys = [b.key for (_, b, enabled, _) in app.screen.active_bindings.values() if enabled]
        assert "k" not in keys


async def test_signal_confirmed_cancelled_and_refused_for_the_engine(daemon):
    daemon.set_write_actions(True)
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        assert app.check_action("signal", ()) is True
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmSignalScreen)
        assert app.screen.query_one("#confirm-box").border_title == "Signal dcgm-exporter (pid 2211)?"
        assert "dcgm-exporter (pid 2211)" in str(app.screen.query_one("#confirm-text").render())
        await pilot.press("escape")  # cancel: nothing sent
        await pilot.pause(0.1)
        assert daemon.posts == []
        await pilot.press("k", "t")
        await until(pilot, lambda: daemon.posts)
        assert daemon.posts == [("/v1/processes/2211/signal", {"signal": "TERM"})]
        await until(pilot, lambda: any("Sent SIGTERM" in n.message for n in app._notifications))
        # the engine is never signalled: no dialog
        await pilot.press("down", "k")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmSignalScreen)
        assert len(daemon.posts) == 1


async def test_signal_refused_by_the_daemon_is_shown(daemon):
    daemon.set_write_actions(True)
    app = make_app(daemon.socket_path, interval=30)  # no poll after the first
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        daemon.set_write_actions(False)  # the config changed under us
        await pilot.press("k")
        await pilot.click("#kill")
        await until(pilot, lambda: any("failed" in n.message for n in app._notifications))
        assert daemon.posts == [("/v1/processes/2211/signal", {"signal": "KILL"})]
        assert any("403" in n.message for n in app._notifications)


async def test_daemon_goes_away_and_comes_back(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        daemon.stop()
        await until(pilot, lambda: app.error is not None)
        banner = app.query_one(Banner)
        assert banner.display
        assert daemon.socket_path in text_of(banner) and "no such socket" in text_of(banner)
        assert "unreachable" in text_of(app.query_one(StatusBar))
        assert rows(app.query_one(ProcessTable)) == ["2211", "48211", "48190", "1312"]  # last data kept
        assert app.query_one("#main").has_class("-stale")
        polls = app.polls
        await until(pilot, lambda: app.polls >= polls + 3)  # keeps retrying
        assert app.is_running
        daemon.start()
        await until(pilot, lambda: app.error is None)
        assert not banner.display and not app.query_one("#main").has_class("-stale")


async def test_starts_without_a_daemon_then_garbage_then_recovers(sock_path):
    app = make_app(sock_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.error is not None)
        assert "no such socket" in app.error and app.snapshot is None
        fake = FakeDaemon(sock_path)
        fake.garbage = True
        fake.start()
        try:
            await until(pilot, lambda: "not JSON" in (app.error or ""))
            assert app.query_one(Banner).display
            fake.garbage = False
            await until(pilot, lambda: app.error is None and app.snapshot is not None)
            assert rows(app.query_one(ProcessTable))[0] == "2211"
        finally:
            fake.stop()


async def test_answers_in_a_wrong_shape_do_not_crash(daemon):
    daemon.update("processes", {"processes": [{"pid": "x"}, 7, None]})
    daemon.update("gpus", {"nvml": {"ok": False, "error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"}, "gpus": None})
    daemon.update("engine", {"up": False, "history": {"running": "nope"}})
    daemon.update("alerts", {"alerts": [{"id": "a"}, {"id": "a", "state": "firing"}]})
    app = make_app(daemon.socket_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.pause(0.3)
        assert app.is_running and app.error is None
        assert "RM_VERSION_MISMATCH" in text_of(app.query_one(".gpu-note"))


async def test_the_ui_does_not_wait_on_a_hung_daemon(sock_path):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)  # accepts into the backlog, never answers
    try:
        app = make_app(sock_path, timeout=30.0)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app._in_flight)  # a poll is stuck in its thread
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)  # keys work meanwhile …
            await pilot.press("escape", "p")
            assert app.paused and app._in_flight  # … while the poll is still stuck
            assert app.polls == 0 and app.snapshot is None
            srv.close()  # resets the stuck connection: the worker ends
            await until(pilot, lambda: not app._in_flight)
            assert app.is_running
    finally:
        srv.close()


def test_cli_top_passes_the_socket(monkeypatch):
    import zerod.tui.app as tui_app
    from zerod.cli import cli

    seen = {}
    monkeypatch.setattr(tui_app, "run", lambda path, interval=1.0, **kw: seen.update(path=path, interval=interval))
    result = CliRunner().invoke(cli, ["top", "--socket", "/tmp/x.sock", "--interval", "0.5"])
    assert result.exit_code == 0, result.output
    assert seen == {"path": "/tmp/x.sock", "interval": 0.5}
    help_ = CliRunner().invoke(cli, ["top", "--help"])
    assert "/run/zerod/control.sock" in help_.output


def test_cli_top_reads_the_socket_from_the_config(monkeypatch, tmp_path):
    import zerod.tui.app as tui_app
    from zerod.cli import cli

    seen = {}
    monkeypatch.setattr(tui_app, "run", lambda path, interval=1.0, **kw: seen.update(path=path))
    monkeypatch.delenv("ZEROD_CONTROL_SOCKET", raising=False)
    cfg = tmp_path / "zerod.toml"
    cfg.write_text('[daemon]\ncontrol_socket = "/tmp/from-config.sock"\n')
    result = CliRunner().invoke(cli, ["top", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert seen == {"path": "/tmp/from-config.sock"}
    result = CliRunner().invoke(cli, ["top", "--config", str(tmp_path / "missing.toml")])
    assert result.exit_code != 0 and "does not exist" in result.output


def test_quit_key(daemon):
    async def go():
        app = make_app(daemon.socket_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.snapshot is not None)
            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running
    asyncio.run(go())


async def test_adapts_when_the_terminal_shrinks(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ProcessTable)
        assert len(table.columns) == 9 and app.screen.has_class("-wide")
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: len(table.columns) == 4)
        assert app.screen.has_class("-narrow") and app.screen.has_class("-short")
        assert rows(table) == ["2211", "48211", "48190", "1312"]
        await pilot.resize_terminal(120, 40)
        await until(pilot, lambda: len(table.columns) == 9)


async def test_another_engine_and_the_learned_normal_are_shown(daemon):
    daemon.data["status"]["engine"]["kind"] = "vllm"
    daemon.data["engine"]["itl_normal_p99_s"] = 0.009
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        panel = app.query_one(EnginePanel)
        assert "· vllm · llama-3-8b-dummy" in str(panel.border_title)
        itl = panel.query_one(".m-itl .metric-value")
        assert "(normal 9.0 ms)" in text_of(itl)
        assert "normal" not in text_of(panel.query_one(".m-ttft .metric-value"))  # not learned yet


async def test_the_engine_panel_counts_its_stalls(daemon):
    """zerod's engine reports slow steps and the last minute's longest gap between tokens:
    the panel shows both beside the stream errors (an engine without them shows neither)."""
    assert "slow steps" not in str(daemon.data["engine"])
    daemon.data["engine"].update(slow_steps_total=3, max_itl_s=0.25)
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        line = text_of(app.query_one(EnginePanel).query_one(".m-errors"))
        assert "slow steps 3" in line and "longest gap 250 ms" in line


async def test_the_host_panel_shows_the_last_diag(daemon):
    """The daemon's last `zerod diag` (its /v1/status `diag`) beside the preflight counts."""
    from zerod.tui.widgets.preflight import PreflightPanel

    daemon.data["status"]["diag"] = {"running": False, "last_error": None,
                                     "last": {"level": "quick", "started_at": NOW - 120, "fail": 1,
                                              "warn": 0, "pass": 8, "skip": 1, "error": 0}}
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        text = text_of(app.query_one(PreflightPanel).query_one("#preflight-text"))
        assert "diag quick ✗1 fail ✓8 pass ·1 skip (2m00s ago)" in text, text
