"""`[daemon] exclusive_gpu`: EXCLUSIVE_PROCESS on the engine's GPUs while it
serves, the previous mode back when that engine process ends; refusals are
warnings, never a stop. NVML is the small fake pynvml of the watcher tests
with the compute-mode calls added (what the H200's driver answered as root:
the switch works while the engine holds the GPU)."""

from __future__ import annotations

import types

from test_daemon_watchers import NVMLError, fake_nvml, firing  # same folder
from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.checks.compute_mode import DEFAULT, EXCLUSIVE_PROCESS
from zerod.watchers.compute_mode import ComputeModeGuard
from zerod.watchers.nvml_session import NvmlSession


def nvml_with_modes(n=2, mode=DEFAULT):
    N = fake_nvml(n)
    for g in N.gpus:
        g.update(mode=mode, mig=0, holders=[], set_error=None)
    N.nvmlDeviceGetComputeMode = lambda g: g["mode"]

    def set_mode(g, mode):
        if g["set_error"] is not None:
            raise NVMLError(g["set_error"])
        g["mode"] = mode

    N.nvmlDeviceSetComputeMode = set_mode
    N.nvmlDeviceGetMigMode = lambda g: (g["mig"], g["mig"])
    N.nvmlDeviceGetComputeRunningProcesses = lambda g: [
        types.SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in g["holders"]]
    return N


class Engine:
    def __init__(self):
        self.pid, self.up = None, False


def guard_for(N, engine, children=lambda pid: set()):
    book = AlertBook()
    cfg = DaemonConfig.from_dict({"exclusive_gpu": True})
    g = ComputeModeGuard(NvmlSession(N), book, cfg, engine_pid=lambda: engine.pid,
                         engine_up=lambda: engine.up, children=children)
    return g, book


def test_exclusive_while_the_engine_serves_restored_on_crash_and_on_stop():
    N = nvml_with_modes(2)
    engine = Engine()
    g, book = guard_for(N, engine, children=lambda pid: {pid + 1})
    engine.pid = 100
    g.poll()
    assert [x["mode"] for x in N.gpus] == [DEFAULT, DEFAULT]  # starting: not yet
    N.gpus[1]["holders"] = [101]  # the engine's worker holds GPU 1
    engine.up = True
    g.poll()
    assert [x["mode"] for x in N.gpus] == [DEFAULT, EXCLUSIVE_PROCESS]  # only the engine's GPU
    assert g.snapshot() == {1: {"exclusive_gpu": True}}
    # the engine crashes; the supervisor starts another process: the GPU is free for it to start
    engine.pid, engine.up = 200, False
    N.gpus[1]["holders"] = []
    g.poll()
    assert N.gpus[1]["mode"] == DEFAULT and not g.held
    N.gpus[1]["holders"] = [200]
    engine.up = True
    g.poll()
    assert N.gpus[1]["mode"] == EXCLUSIVE_PROCESS
    # the daemon stops
    g.restore()
    assert N.gpus[1]["mode"] == DEFAULT and not book.firing()


def test_a_gpu_already_exclusive_is_left_so():
    N = nvml_with_modes(1, mode=EXCLUSIVE_PROCESS)
    engine = Engine()
    g, _ = guard_for(N, engine)
    engine.pid, engine.up = 7, True
    N.gpus[0]["holders"] = [7]
    g.poll()
    g.restore()
    assert N.gpus[0]["mode"] == EXCLUSIVE_PROCESS


def test_refusals_are_warnings_and_the_next_engine_tries_again(caplog):
    N = nvml_with_modes(2)
    engine = Engine()
    g, book = guard_for(N, engine)
    N.gpus[0].update(holders=[7], set_error=4)  # NVML_ERROR_NO_PERMISSION: not root
    N.gpus[1].update(holders=[7], mig=1)
    engine.pid, engine.up = 7, True
    g.poll()
    g.poll()
    alerts = {a.key: a for a in firing(book, "ExclusiveGpuRefused")}
    assert alerts["0"].severity == "warning" and "needs root" in alerts["0"].summary
    assert "MIG is enabled" in alerts["1"].summary
    assert [x["mode"] for x in N.gpus] == [DEFAULT, DEFAULT]
    assert sum("stays as it is" in r.message for r in caplog.records) == 2  # once each, not every tick
    N.gpus[0]["set_error"] = None
    engine.pid = 8
    N.gpus[0]["holders"] = [8]
    g.poll()
    assert N.gpus[0]["mode"] == EXCLUSIVE_PROCESS and "0" not in {a.key for a in firing(book, "ExclusiveGpuRefused")}


def test_gpus_doc_says_which_gpu_the_daemon_holds_exclusive():
    from test_daemon_metrics import _views

    N = nvml_with_modes(2)
    views = _views(N)
    engine = Engine()
    g, _ = guard_for(N, engine)
    g.session = views.nvml_stats.session
    views.engines[0].compute_mode = g
    engine.pid, engine.up = 7, True
    N.gpus[0]["holders"] = [7]
    g.poll()
    views.nvml_stats.poll()
    doc = views.gpus()["gpus"]
    assert [(x["exclusive_gpu"], x["exclusive_refused"]) for x in doc] == [(True, None), (False, None)]
    assert [x["compute_mode"] for x in doc] == ["Exclusive_Process", "Default"]
