"""SVG snapshots of `zerod top` (pytest-textual-snapshot) on the recorded control-API
data of a one-GPU and an eight-GPU host, at 80×24 (the smallest supported size),
120×40 and 160×48. The clock is injected, so
every relative time on screen is fixed. Update with `pytest --snapshot-update`."""

from __future__ import annotations

import copy
import shutil
import tempfile
import time

import pytest
import textual

from tui_fake_daemon import EIGHT_GPUS, NOW, FakeDaemon
from zerod.tui.app import ZerodTop

# The SVGs depend on Textual's rendering: they were recorded with this version. Another
# version is skipped with the reason (re-record with --snapshot-update), not failed.
RECORDED_WITH = "8.2.8"
pytestmark = pytest.mark.skipif(
    textual.__version__ != RECORDED_WITH,
    reason=f"snapshots recorded with textual {RECORDED_WITH}, this is {textual.__version__}")


@pytest.fixture
def daemon(monkeypatch):
    # A relative socket path in a temporary working directory: the path shows on
    # screen (banner, help), so it must not carry the random directory name.
    d = tempfile.mkdtemp(prefix="zt")
    monkeypatch.chdir(d)
    fake = FakeDaemon("control.sock").start()
    yield fake
    fake.stop()
    shutil.rmtree(d, ignore_errors=True)


def app_for(daemon: FakeDaemon) -> ZerodTop:
    return ZerodTop(daemon.socket_path, interval=0.2, timeout=1.0, clock=lambda: NOW)


async def until(pilot, cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await pilot.pause(0.02)
    await pilot.pause()


def loaded(app: ZerodTop):
    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
    return run_before


def test_dashboard_120x40(snap_compare, daemon):
    app = app_for(daemon)
    assert snap_compare(app, terminal_size=(120, 40), run_before=loaded(app))


def test_dashboard_80x24(snap_compare, daemon):
    app = app_for(daemon)
    assert snap_compare(app, terminal_size=(80, 24), run_before=loaded(app))


def test_daemon_unreachable_80x24(snap_compare, daemon):
    app = app_for(daemon)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
        daemon.stop()
        await until(pilot, lambda: app.error is not None)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_signal_confirmation_120x40(snap_compare, daemon):
    daemon.set_write_actions(True)
    app = app_for(daemon)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("k")

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


def test_filter_and_help_80x24(snap_compare, daemon):
    app = app_for(daemon)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("slash", *"dcgm", "enter", "question_mark")

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.fixture
def eight(monkeypatch):
    """The recorded 8-GPU host: two TP4 engines, alice's rogue job on GPU 5, GPU 3 throttled."""
    d = tempfile.mkdtemp(prefix="zt")
    monkeypatch.chdir(d)
    fake = FakeDaemon("control.sock", EIGHT_GPUS).start()
    yield fake
    fake.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_dashboard_160x48(snap_compare, daemon):
    app = app_for(daemon)
    assert snap_compare(app, terminal_size=(160, 48), run_before=loaded(app))


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (160, 48)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_eight_gpus(snap_compare, eight, size):
    """One line per GPU up to 120x40; a panel per GPU, four across, at 160x48."""
    app = app_for(eight)
    assert snap_compare(app, terminal_size=size, run_before=loaded(app))


def test_eight_gpus_tree_by_cpu_engine_b_160x48(snap_compare, eight):
    """The process tree sorted by host CPU, engine b in the Engine panel (its GPUs highlighted)."""
    app = app_for(eight)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("t", *"ssss", "e")  # tag, user, GPU memory, SM, then host CPU

    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)


def test_history_120x40(snap_compare, daemon):
    app = app_for(daemon)

    async def run_before(pilot) -> None:
        await until(pilot, lambda: app.snapshot is not None)
        await pilot.press("h")
        await until(pilot, lambda: getattr(app.screen, "doc", None) is not None)

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


@pytest.mark.parametrize("gpus", [True, False], ids=["eight_gpus", "no_gpu"])
def test_standalone_120x40(snap_compare, monkeypatch, gpus):
    """No daemon: this host read directly (a recorded stand-in), with the banner."""
    from test_tui_processes import local_snapshot

    monkeypatch.chdir(tempfile.mkdtemp(prefix="zt"))
    app = ZerodTop("control.sock", interval=0.2, timeout=1.0, clock=lambda: NOW, local=local_snapshot(gpus),
                   start_hint="sudo systemctl start zerod")
    assert snap_compare(app, terminal_size=(120, 40), run_before=loaded(app))


def test_two_engines_120x40(snap_compare, daemon):
    """A 2 x TP1 host ([[engines]]): a line per engine under the top row, the second
    restarting after a crash (/v1/gpus carries each GPU's engine too)."""
    first = dict(daemon.data["status"]["engine"], name="llama-a", gpus=[0])
    second = dict(first, name="llama-b", gpus=[1], state="restarting", restarts=2, pid=None,
                  url="http://127.0.0.1:8002")
    daemon.data["status"]["engines"] = [first, second]
    daemon.data["engines"] = {"engines": [{**first, **daemon.data["engine"]},
                                          {**second, **daemon.data["engine"], "up": False}]}
    gpu = daemon.data["gpus"]["gpus"][0]
    daemon.data["gpus"]["gpus"] = [dict(copy.deepcopy(gpu), engine="llama-a"),
                                   dict(copy.deepcopy(gpu), index=1, engine="llama-b")]
    app = app_for(daemon)
    assert snap_compare(app, terminal_size=(120, 40), run_before=loaded(app))
