"""The fault alerts end to end on the CPU: a daemon supervising the real demo
engine (`zerod serve --model demo`) started with ZEROD_FAULT.

- stall-after-steps: EngineStalled within stall_after_s of the stall (plus a
  scrape), with the step thread's stack and the last step's shape, the engine
  restarted, the events kept, a bundle written by the flight recorder;
- corrupt-after-steps: rounds that agree, then CanaryMismatch with the prompts
  and both answers; the canary's requests never reach the engine's metrics.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tarfile
import time

import aiohttp
import psutil
import pytest

from test_daemon_lifecycle import free_port  # same folder
from zerod.daemon import Daemon
from zerod.engine import metrics as names
from zerod.event_store import EventStore


def _config(tmp_path, port: int, fault: str, serve: dict | None = None, **daemon) -> dict:
    return {"engine": {"port": port, "max_num_seqs": 4, **(serve or {})}, "doctor": {}, "alerts": {},
            "daemon": {"preflight": False, "numa": "off", "metrics_port": -1, "netlink": False,
                       "control_socket": str(tmp_path / "control.sock"), "watch_interval_s": 0.2,
                       "state_dir": str(tmp_path / "state"), "engine_env": {"ZEROD_FAULT": fault},
                       "stall_after_s": 0, "canary_interval_s": 0, **daemon}}


async def _until(d: Daemon, what, seconds: float, why: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if d.views is not None and what():
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {why} within {seconds} s")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _stop(d: Daemon, run: asyncio.Task) -> None:
    if not run.done():
        d._on_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(run), 30)
        except asyncio.TimeoutError:
            d._on_signal(signal.SIGTERM)
            await asyncio.gather(run, return_exceptions=True)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_a_stalled_engine_is_named_with_its_stack_and_restarted(tmp_path, engine_process):
    """With --engine-process the step thread's stack comes from the engine's own process
    (the pid /health names, a descendant of the one the daemon started)."""
    port = free_port()
    d = Daemon(_config(tmp_path, port, "stall-after-steps:30", {"engine_process": engine_process},
                       stall_after_s=2.0, bundle_min_interval_s=0), demo=True)
    run = asyncio.create_task(d.run())
    stuck = None
    try:
        await _until(d, lambda: d.ready_at is not None, 120, "READY")
        first_pid = d.supervisors[0].pid

        async def long_request():
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"prompt": "hello", "max_tokens": 200, "ignore_eos": True},
                                  timeout=aiohttp.ClientTimeout(total=60)) as r:
                    return await r.read()

        stuck = asyncio.create_task(long_request())
        took = await _until(d, lambda: d.book.get("EngineStalled") is not None
                            or any(e.get("alertname") == "EngineStalled" for e in d.recorder.store.query()),
                            30, "EngineStalled")
        # the stall begins within a second of the request (30 steps); then stall_after_s and a scrape
        assert took < 2.0 + 3.0, took
        [fired] = [e for e in d.recorder.store.query() if e["alertname"] == "EngineStalled"][:1]
        assert fired["state"] == "firing" and fired["severity"] == "critical"
        assert "1 request(s) running, no token for" in fired["summary"]
        desc = fired["description"]
        assert "last step #30: 1 rows" in desc and "1 decodes" in desc  # the last step's shape
        assert "step thread stack:" in desc and "_loop_body" in desc and "faults.py" in desc  # where it waits
        assert "no GPU reading" in desc  # the CPU: said, not invented
        # by policy, a restart: a new process, the restart's reason naming the stall
        first_engine = [c.pid for c in psutil.Process(first_pid).children()] if engine_process else []
        await _until(d, lambda: d.supervisors[0].pid not in (None, first_pid) and d.supervisors[0].fig.restarts >= 1,
                     60, "a restart")
        # the stalled engine's own process does not linger beside the new one
        await _until(d, lambda: all(_gone(p) for p in first_engine), 10, "the stalled engine process gone")
        assert "stalled" in (d.supervisors[0].fig.last_exit or "")
        # the flight recorder's bundle, with the stack and the event in it
        await _until(d, lambda: bool(d.recorder.bundles_written), 60, "a bundle")
        with tarfile.open(d.recorder.bundles_written[0]) as tar:
            files = {m.name.split("/", 1)[1]: m for m in tar.getmembers()}
            events = json.loads(tar.extractfile(files["events.json"]).read())
            assert "EngineStalled" in [e["alertname"] for e in events]
            assert "_loop_body" in tar.extractfile(files["stacks-default.txt"]).read().decode()
            assert "daemon.json" in files
        await _stop(d, run)
        assert run.result() == 0
        kept = EventStore.for_reading(str(tmp_path / "state")).query()
        assert [e["alertname"] for e in kept if e["kind"] == "daemon"][:2] == ["DaemonStarted", "DaemonReady"]
        assert kept[-1]["alertname"] == "DaemonStopped"
    finally:
        if stuck is not None:
            stuck.cancel()
            await asyncio.gather(stuck, return_exceptions=True)
        await _stop(d, run)


async def test_the_canary_catches_perturbed_weights_and_stays_out_of_the_metrics(tmp_path):
    port = free_port()
    # the record takes 3 x 16 steps (ignore_eos), each round as many: two rounds agree before the fault
    d = Daemon(_config(tmp_path, port, "corrupt-after-steps:144", canary_interval_s=0.5, bundle_on_critical=False),
               demo=True)
    run = asyncio.create_task(d.run())
    try:
        await _until(d, lambda: d.ready_at is not None, 120, "READY")
        [canary] = [w for w in d.fault_watchers if w.name == "canary"]
        await _until(d, lambda: canary.reference is not None, 30, "the canary's record")
        await _until(d, lambda: canary.rounds >= 1, 30, "a canary round")
        assert d.book.get("CanaryMismatch") is None  # a healthy engine answers as at its start
        await _until(d, lambda: d.book.get("CanaryMismatch") is not None, 60, "CanaryMismatch")
        a = d.book.get("CanaryMismatch")
        assert a.severity == "critical" and "differently than at its start, twice" in a.summary
        assert "GPU 0" in a.summary and a.labels["gpu"] == "0"
        first = json.dumps(canary.prompts[-1])
        assert first in a.description and json.dumps(canary.reference[-1].text) in a.description
        assert "now " in a.description
        assert all(t.startswith("token_id:") for t in canary.reference[-1].tokens)   # compared by id
        # every canary token so far was unmetered: the engine counts none
        last = d.views.engines[0].engine_metrics.last
        assert last.values[names.GENERATION_TOKENS_TOTAL] == 0 and last.itl.count == 0 and last.ttft.count == 0
    finally:
        await _stop(d, run)


async def test_a_vllm_engine_stalled_is_told_from_its_metrics(tmp_path):
    """vLLM's stuck engine: /health 200, requests running, vllm:generation_tokens flat."""
    import os
    import shutil
    import sys

    from test_daemon_engines import FAKE_VLLM

    port = free_port()
    config = _config(tmp_path, port, "", engine="vllm", stall_after_s=1.5, bundle_on_critical=False,
                     engine_command=[sys.executable, str(FAKE_VLLM), str(port)])
    del config["daemon"]["engine_env"]
    d = Daemon(config)
    run = asyncio.create_task(d.run())
    try:
        await _until(d, lambda: d.ready_at is not None, 30, "READY")
        await _until(d, lambda: (d.views.engine().get("output_tokens_per_s") or 0) > 0, 15, "tokens")
        assert d.book.get("EngineStalled") is None  # tokens flowing: no verdict against it
        first_pid = d.supervisors[0].pid
        os.kill(first_pid, signal.SIGUSR2)
        took = await _until(d, lambda: any(e["alertname"] == "EngineStalled" for e in d.recorder.store.query()),
                            15, "EngineStalled")
        assert took < 1.5 + 2.0, took
        [e] = [e for e in d.recorder.store.query() if e["alertname"] == "EngineStalled"][:1]
        assert "32 request(s) running, no token for" in e["summary"]
        assert "last step: not reported by this engine" in e["description"]
        if shutil.which("py-spy") is None:
            assert "a vllm engine has no ZEROD_STACK_FILE and py-spy is not installed" in e["description"]
        await _until(d, lambda: d.supervisors[0].pid not in (None, first_pid), 30, "a restart")
    finally:
        await _stop(d, run)


def test_engine_stalled_evidence_reads_the_gpu_layer_where_nvml_has_gpus():
    """On a host with GPUs the stall alert's evidence names each engine GPU's reading (the
    daemon's NVML watcher holds typed GPU readings: the watcher gets their rows)."""
    from test_daemon_watchers import fake_nvml

    config = {"engines": [{"name": "a", "model": "demo", "gpus": [0], "port": 18011}],
              "daemon": {"metrics_port": -1, "numa": "off", "netlink": False, "canary_interval_s": 0},
              "doctor": {}, "alerts": {}}
    d = Daemon(config, nvml=fake_nvml(1))
    d._build()
    d._nvml_stats.poll()
    [stall] = [w for w in d.fault_watchers if w.name.startswith("engine_stall")]
    rows = stall.gpus()
    assert [r["index"] for r in rows] == [0] and rows[0]["memory_used_bytes"] > 0
    stall._fire(2, 100, 10.0, {"gpus": rows, "health": {}})
    [alert] = d.book.firing("EngineStalled")
    assert "GPU 0: 50% busy" in alert.description
