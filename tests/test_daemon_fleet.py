"""Several engines in one daemon ([[engines]]): `Daemon.run()` in this process
supervising two stand-in engines on GPUs 0 and 1, its process watcher re-rooted
on a fake /proc tree. Both are supervised and listed; one killed is restarted
alone; /metrics labels each engine; a foreign process on engine b's GPU is
attributed to b alone."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

from test_daemon_foreign import add_proc  # same folder
from test_daemon_lifecycle import FAKE_ENGINE, free_port
from zerod.checks.facts import Roots
from zerod.cmd_config import check_config
from zerod.daemon import Daemon
from zerod.fleet import engine_specs


def fleet_config(tmp_path: Path) -> dict:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    engines = []
    for name, gpu in (("a", 0), ("b", 1)):
        port = free_port()
        engines.append({"name": name, "gpus": [gpu], "port": port,
                        "engine_command": [sys.executable, str(script), str(port), str(tmp_path / f"{name}.json")]})
    return {"engine": {"model": "demo"}, "engines": engines, "doctor": {}, "alerts": {},
            "daemon": {"control_socket": str(tmp_path / "control.sock"), "metrics_port": 0,
                       "full_scan_interval_s": 30, "restart_backoff_initial_s": 0.2}}


async def until(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


async def test_two_engines_supervised_listed_restarted_alone_and_attributed(tmp_path):
    config = fleet_config(tmp_path)
    assert check_config(config) == []
    proc = tmp_path / "proc"
    proc.mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    d = Daemon(config, demo=True, proc_roots=Roots.make(procfs=str(proc), rootfs=str(tmp_path)))
    task = asyncio.create_task(d.run())
    conn = aiohttp.UnixConnector(path=config["daemon"]["control_socket"])
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            async def get(path, status=200):
                async with http.get("http://zerod" + path) as r:
                    assert r.status == status, (path, r.status)
                    return await r.json()

            async def metrics():
                host, port = d.metrics_address
                async with aiohttp.ClientSession() as plain:
                    async with plain.get(f"http://{host}:{port}/metrics") as r:
                        return await r.text()

            await until(lambda: d.ready_at is not None, 30, "both engines healthy")
            a, b = d.supervisors
            assert (a.spec.name, b.spec.name) == ("a", "b")
            # each child sees its own GPU, in NVML's order
            assert environ(a.pid)["CUDA_VISIBLE_DEVICES"] == "0" and environ(b.pid)["CUDA_VISIBLE_DEVICES"] == "1"
            assert environ(b.pid)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

            st = await get("/v1/status")
            assert [(e["name"], e["gpus"], e["state"]) for e in st["engines"]] == [
                ("a", [0], "healthy"), ("b", [1], "healthy")]
            assert st["engine"]["url"] == a.url  # "the engine" of a one-engine client: the first
            listed = (await get("/v1/engines"))["engines"]
            assert [e["name"] for e in listed] == ["a", "b"] and listed[1]["url"] == b.url
            assert (await get("/v1/engine?engine=b"))["url"] == b.url
            assert "no engine named 'c'; engines: a, b" in (await get("/v1/engine?engine=c", 404))["error"]
            await until(lambda: len(d.views.history.times) >= 2, 5, "two history samples")
            hist = await get("/v1/history?seconds=60&points=30")
            assert [e["name"] for e in hist["engines"]] == ["a", "b"] and hist["points"] == 30
            assert all(len(e["series"]["itl_p99_s"]) == 30 for e in hist["engines"])
            assert [e["name"] for e in (await get("/v1/history?engine=b"))["engines"]] == ["b"]
            assert "no engine named 'c'" in (await get("/v1/history?engine=c", 404))["error"]
            assert "seconds must be a number" in (await get("/v1/history?seconds=soon", 400))["error"]
            assert "unknown parameter 'window'" in (await get("/v1/history?window=60", 400))["error"]
            text = await metrics()
            assert 'zerod_engine_up{engine="a"} 1.0' in text and 'zerod_engine_up{engine="b"} 1.0' in text
            assert text.count("# TYPE zerod_engine_up gauge") == 1

            # engine a killed: a restarted alone, b untouched
            b_pid = b.pid
            os.kill(a.pid, signal.SIGKILL)
            await until(lambda: d.book.get("EngineDown", "a") is not None, 5, "EngineDown for a")
            down = d.book.get("EngineDown", "a")
            assert down.labels["engine"] == "a" and "engine a down" in down.summary
            await until(lambda: a.fig.state == "healthy" and a.fig.restarts == 1, 10, "a restarted")
            assert b.pid == b_pid and b.fig.restarts == 0 and d.book.get("EngineDown", "b") is None
            text = await metrics()
            assert 'zerod_engine_restarts_total{engine="a"} 1.0' in text
            assert 'zerod_engine_restarts_total{engine="b"} 0.0' in text

            # a job on GPU 1 is engine b's problem alone
            add_proc(proc, 777, "python3", "python3 train.py", "train.service", devs=("/dev/nvidia1",))
            await until(lambda: d.book.get("ForeignGpuProcess", "777") is not None, 3, "ForeignGpuProcess")
            alert = d.book.get("ForeignGpuProcess", "777")
            assert alert.labels["engine"] == "b" and alert.summary == "python3 (pid 777) holds GPU 1 (engine b)"
            [row] = [r for r in (await get("/v1/processes"))["processes"] if r["pid"] == 777]
            assert row["role"] == "foreign" and row["engines"] == ["b"]
            la, lb = (e.latency for e in d.views.engines)
            assert [c["pid"] for c in lb.likely_causes(time.time())] == [777]
            assert la.likely_causes(time.time()) == []
            gpus = {g["index"]: g["engine"] for g in (await get("/v1/gpus"))["gpus"]}
            assert gpus in ({}, {0: "a", 1: "b"})  # no NVML here: no GPU rows
    finally:
        if d._stop is not None:
            d._stop.set()
        else:
            task.cancel()
        assert await asyncio.wait_for(task, 30) == 0


def test_one_engine_table_stays_the_default_engine_untagged():
    [spec] = engine_specs({"engine": {"model": "demo", "port": 8001}}, gpu_index=3)
    assert (spec.name, spec.gpus, spec.tagged, spec.labels, spec.key("itl")) == ("default", (3,), False, {}, "itl")
    assert spec.child_env() == {}  # no CUDA_VISIBLE_DEVICES: as before [[engines]]


def test_engines_inherit_the_engine_table_and_get_their_tensor_parallel_size():
    a, b = engine_specs({"engine": {"model": "/srv/llama", "max_num_seqs": 64},
                         "engines": [{"name": "a", "gpus": [0, 1, 2, 3], "port": 8001},
                                     {"name": "b", "gpus": [4], "port": 8002, "max_num_seqs": 8}]})
    assert a.flags() == {"model": "/srv/llama", "max_num_seqs": 64, "port": 8001, "tensor_parallel_size": 4}
    assert b.flags() == {"model": "/srv/llama", "max_num_seqs": 8, "port": 8002}  # TP1: no flag
    assert a.child_env()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and a.key("itl") == "a:itl"
