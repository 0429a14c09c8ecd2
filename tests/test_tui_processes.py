"""`zerod top`'s process table as nvitop shows it, the engine picker, the history
screen and standalone mode, driven with Textual's Pilot against the recorded 8-GPU
host (tests/fixtures/control_api/eight_gpus: two TP4 engines, alice's rogue training
job on GPU 5 under her shell, a dcgm-exporter)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import pytest

from test_tui_app import make_app, rows, text_of, until
from tui_fake_daemon import EIGHT_GPUS, FakeDaemon, load_fixtures
from zerod.tui.client import Snapshot
from zerod.tui.screens.history import HistoryScreen
from zerod.tui.widgets.banner import Banner
from zerod.tui.widgets.engine import EnginePanel
from zerod.tui.widgets.gpu import GpuPanel
from zerod.tui.widgets.processes import ProcessTable

SIZE = (160, 48)
ENGINE_A = ["50100", "50101", "50102", "50103"]
ENGINE_B = ["50200", "50201", "50202", "50203"]


@pytest.fixture
def daemon():
    d = tempfile.mkdtemp(prefix="zt")
    fake = FakeDaemon(os.path.join(d, "control.sock"), EIGHT_GPUS).start()
    yield fake
    fake.stop()
    shutil.rmtree(d, ignore_errors=True)


def column(table: ProcessTable, label: str) -> list[str]:
    """The text of one column, top to bottom (label without the sort arrow)."""
    keys = [c.key for c in table.columns.values() if str(c.label).rstrip("▲▼") == label]
    assert keys, f"no column {label}: {[str(c.label) for c in table.columns.values()]}"
    return [str(table.get_cell(r, keys[0])) for r in table.rows]


async def test_sorts_by_any_column_from_the_keyboard(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ProcessTable)
        # by tag: foreign first (the job with memory, then the agent), then the engines' processes
        assert rows(table)[:2] == ["7001", "2211"] and set(rows(table)[2:10]) == set(ENGINE_A + ENGINE_B)
        await pilot.press("s", "s")  # tag -> user -> GPU memory
        assert table.sort_key == "gpu_mem"
        mem = [p["gpu_memory_bytes"] for p in (table.process(k) for k in rows(table))]
        assert mem == sorted(mem, reverse=True)  # largest first, as nvitop
        assert any(str(c.label) == "GPU MEM▼" for c in table.columns.values())
        await pilot.press("r")  # reversed: smallest first
        mem = [p["gpu_memory_bytes"] for p in (table.process(k) for k in rows(table))]
        assert mem == sorted(mem) and any(str(c.label) == "GPU MEM▲" for c in table.columns.values())
        await pilot.press("s", "s")  # -> SM -> CPU, largest first; rows without a figure last
        assert table.sort_key == "cpu"
        assert rows(table)[0] in ENGINE_A + ENGINE_B and column(table, "CPU")[0] == "99%"
        assert rows(table)[-1] in ("48190", "1312")  # 3 % and 0 %
        await pilot.press("S")  # back one: SM
        assert table.sort_key == "sm" and column(table, "SM")[0] == "90%"
        await pilot.press("s", "s", "s", "s", "s")  # CPU, RSS, TIME, COMMAND, then round to PID
        assert table.sort_key == "pid"
        pids = [int(k) for k in rows(table)]
        assert pids == sorted(pids)
        assert "sort pid ▲" in str(app.query_one("#processes").border_title)


async def test_filters_by_user_gpu_and_foreign_only(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ProcessTable)
        await pilot.press("slash", *"user:alice", "enter")
        assert rows(table) == ["7001"]
        assert "filter 'user:alice': 1 shown" in str(app.query_one("#processes").border_title)
        await pilot.press("slash", "escape")  # cleared
        assert len(rows(table)) == 12
        await pilot.press("slash", *"gpu:5", "enter")  # alice's job and engine b's rank 1
        assert sorted(rows(table)) == ["50201", "7001"]
        await pilot.press("slash", "escape", "f")  # foreign only
        assert rows(table) == ["7001", "2211"]
        await pilot.press("f", "g")  # all again, then GPU 0 alone
        assert rows(table) == ["50100"] and table.gpu == 0
        for _ in range(7):
            await pilot.press("g")
        assert table.gpu == 7 and rows(table) == ["50203"]
        await pilot.press("g")  # after the last GPU: every GPU again
        assert table.gpu is None and len(rows(table)) == 12


async def test_tree_shows_parents_and_children(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        table = app.query_one(ProcessTable)
        await pilot.press("t")
        order = rows(table)
        # alice's shell, not a GPU process, shown once above her job
        assert order.index("parent-6990") + 1 == order.index("7001")
        assert column(table, "COMMAND")[order.index("7001")].startswith("└ python3 train.py")
        # the daemon, then each engine's leader under it, its three ranks under the leader
        z, a = order.index("48190"), order.index("50100")
        assert z < a and order[a + 1:a + 4] == ENGINE_A[1:]
        commands = column(table, "COMMAND")
        assert commands[a].startswith("├ python3 -m zerod serve") or commands[a].startswith("└ python3 -m zerod")
        assert commands[a + 3].startswith("  └ zerod-tp3")
        assert "tree" in str(app.query_one("#processes").border_title)
        # a parent row is not a process: Enter opens nothing, k has nothing to signal
        table.move_cursor(row=order.index("parent-6990"))
        assert table.selected() is None
        await pilot.press("t")
        assert not any(k.startswith("parent-") for k in rows(table))


async def test_engine_picker_and_its_gpus(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await until(pilot, lambda: len(app.query(GpuPanel)) == 8)
        panel = app.query_one(EnginePanel)
        assert "a (1/2)" in str(panel.border_title)
        chosen = lambda: sorted(p.index for p in app.query(GpuPanel) if p.has_class("-chosen"))  # noqa: E731
        await until(pilot, lambda: chosen() == [0, 1, 2, 3])
        await pilot.press("e")
        assert "b (2/2)" in str(panel.border_title) and app.engine_name == "b"
        await until(pilot, lambda: chosen() == [4, 5, 6, 7])
        # engine b's own figures, from /v1/engines
        assert "41.2 ms" in text_of(panel.query_one(".m-itl .metric-value"))
        await pilot.press("e")  # round to a
        assert app.engine_name == "a" and "a (1/2)" in str(panel.border_title)
        await pilot.press("E")
        assert app.engine_name == "b"


async def test_one_engine_has_no_picker():
    d = tempfile.mkdtemp(prefix="zt")
    fake = FakeDaemon(os.path.join(d, "control.sock")).start()
    try:
        app = make_app(fake.socket_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.snapshot is not None)
            assert app.check_action("engine", (1,)) is False
            await pilot.press("e")
            assert app.engine_name is None
    finally:
        fake.stop()
        shutil.rmtree(d, ignore_errors=True)


async def test_history_screen_reads_the_daemon_and_zooms(daemon):
    app = make_app(daemon.socket_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("e", "h")
        screen = app.screen
        assert isinstance(screen, HistoryScreen) and screen.engine == "b"
        await until(pilot, lambda: screen.doc is not None)
        assert daemon.queries[-1].startswith("seconds=600&points=") and daemon.queries[-1].endswith("&engine=b")
        text = str(screen.query_one("#history-text").render())
        assert "GPU 7" in text and "engine b · ITL p99" in text and "engine a" not in text
        n = len(daemon.queries)
        await pilot.press("minus")  # zoom out: 30 minutes
        await until(pilot, lambda: len(daemon.queries) > n)
        assert daemon.queries[-1].startswith("seconds=1800&")
        await pilot.press("minus", "minus")  # the hour is the widest
        await until(pilot, lambda: daemon.queries[-1].startswith("seconds=3600&"))
        await pilot.press("plus", "plus", "plus", "plus", "plus")  # down to a minute, no further
        await until(pilot, lambda: daemon.queries[-1].startswith("seconds=60&"))
        await pilot.press("escape")
        assert not isinstance(app.screen, HistoryScreen)


def local_snapshot(gpus: bool = True):
    """A standalone reader returning the recorded host as this host would read it."""
    docs = load_fixtures(EIGHT_GPUS)

    def read(now: float) -> Snapshot:
        g = copy.deepcopy(docs["gpus"]) if gpus else {
            "nvml": {"ok": False, "error": "no NVIDIA driver found: libnvidia-ml.so.1 is not installed",
                     "driver_version": None}, "gpus": []}
        procs = [dict(p, engines=[], role="engine" if p["role"] == "daemon" else p["role"])
                 for p in docs["processes"]["processes"]] if gpus else []
        return Snapshot(status={"host": "gpu-h200-07", "version": "0.1.0", "standalone": True, "engine": {},
                                "engines": [], "write_actions": False, "preflight": None},
                        checks=json.loads(json.dumps(docs["checks"])), gpus=g, processes={"processes": procs},
                        alerts={"alerts": []}, engine={}, taken_at=now)
    return read


async def test_standalone_without_a_daemon(tmp_path):
    app = make_app(str(tmp_path / "none.sock"), local=local_snapshot(), start_hint="sudo systemctl start zerod")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        assert app.source == "local" and app.error is not None
        banner = text_of(app.query_one(Banner))
        assert "The zerod daemon is not running" in banner and "sudo systemctl start zerod" in banner
        assert "doctor's last report (1m00s ago)" in banner
        assert len(app.query(GpuPanel)) == 8 or len(rows(app.query_one(ProcessTable))) == 12
        assert rows(app.query_one(ProcessTable))[0] == "7001"
        assert app.check_action("signal", ()) is False  # no daemon, no write actions
        await pilot.press("h")
        assert "kept by the daemon" in str(app.screen.query_one("#history-text").render())


async def test_standalone_on_a_host_without_an_nvidia_gpu(tmp_path):
    app = make_app(str(tmp_path / "none.sock"), local=local_snapshot(gpus=False), start_hint="zerod run")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.snapshot is not None)
        banner = text_of(app.query_one(Banner))
        assert "No NVIDIA GPU to show: no NVIDIA driver found" in banner
        assert "gpu-h200-07" in text_of(app.query_one("#preflight-text"))  # the host panel still shows
        assert "NVML unavailable" in text_of(app.query_one(".gpu-note"))


async def test_back_to_the_daemon_when_it_starts(tmp_path):
    path = str(tmp_path / "control.sock")
    app = make_app(path, local=local_snapshot())
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.source == "local" and app.snapshot is not None)
        fake = FakeDaemon(path, EIGHT_GPUS).start()
        try:
            await until(pilot, lambda: app.source == "daemon" and app.error is None, timeout=10)
            assert not app.query_one(Banner).display
            assert "a (1/2)" in str(app.query_one(EnginePanel).border_title)
        finally:
            fake.stop()
