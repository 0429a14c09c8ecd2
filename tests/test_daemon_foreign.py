"""The daemon's wiring end to end for a foreign process: `Daemon.run()` in this
process with its process watcher re-rooted on a fake /proc tree (the real scan
of zerod.checks reads it), a stand-in engine; an agent that appears holding
/dev/nvidiactl is alerted within 2 s, named with its unit and fix, shown in
/v1/processes and counted in /metrics; it goes away: resolved."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time

import aiohttp

from test_daemon_lifecycle import FAKE_ENGINE, free_port  # same folder
from zerod.checks.facts import Roots
from zerod.daemon import Daemon


def add_proc(proc, pid, name, cmdline, unit, devs=("/dev/nvidiactl", "/dev/nvidia0")):
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True)
    for i, dev in enumerate(devs, start=3):
        os.symlink(dev, d / "fd" / str(i))
    (d / "comm").write_text(name + "\n")
    (d / "cmdline").write_text(cmdline.replace(" ", "\0") + "\0")
    (d / "status").write_text(f"Name:\t{name}\nUid:\t0\t0\t0\t0\n")
    (d / "stat").write_text(f"{pid} ({name}) S 1 {pid} {pid} 0 -1 0\n")
    (d / "cgroup").write_text(f"0::/system.slice/{unit}\n")


async def test_foreign_process_alerted_within_2s_through_the_daemon(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    add_proc(proc, 100, "bash", "/bin/bash", "sshd.service", devs=("/dev/null",))
    port = free_port()
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    sock = str(tmp_path / "control.sock")
    d = Daemon({"engine": {"port": port}, "doctor": {}, "alerts": {},
                "daemon": {"control_socket": sock, "metrics_port": 0, "full_scan_interval_s": 30,
                           "engine_command": [sys.executable, str(script), str(port), str(tmp_path / "st.json")]}},
               demo=True, proc_roots=Roots.make(procfs=str(proc), rootfs=str(tmp_path)))
    task = asyncio.create_task(d.run())
    conn = aiohttp.UnixConnector(path=sock)
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            async def get(path):
                async with http.get("http://zerod" + path) as r:
                    return await r.json()

            end = time.monotonic() + 30
            while d.ready_at is None and time.monotonic() < end:
                await asyncio.sleep(0.1)
            assert d.ready_at is not None
            await asyncio.sleep(1.5)  # a few quiet ticks: no full scans without a change
            scans = d.views.processes.full_scans
            await asyncio.sleep(1.5)
            assert d.views.processes.full_scans == scans
            # the agent appears (an nvmlInit-only Datadog agent: only the fd scan can see it)
            t0 = time.monotonic()
            add_proc(proc, 488, "datadog-agent", "/opt/datadog-agent/bin/agent/agent run",
                     "datadog-agent.service")
            alert = None
            while time.monotonic() - t0 < 3:
                alerts = (await get("/v1/alerts"))["alerts"]
                alert = next((a for a in alerts if a["alertname"] == "ForeignGpuProcess"
                              and a["state"] == "firing"), None)
                if alert:
                    break
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            assert alert is not None and took <= 2.0, took
            assert alert["summary"] == "datadog-agent (pid 488) holds GPU 0"
            assert alert["labels"]["unit"] == "datadog-agent.service" and "nvml.d" in alert["fix"]
            rows = (await get("/v1/processes"))["processes"]
            [row] = [r for r in rows if r["pid"] == 488]
            assert row["role"] == "foreign" and row["known_agent"] == "datadog-agent"
            host, mport = d.metrics_address
            async with aiohttp.ClientSession() as plain:
                async with plain.get(f"http://{host}:{mport}/metrics") as r:
                    text = await r.text()
            assert "zerod_foreign_gpu_processes 1.0" in text
            assert 'zerod_alerts_firing{alertname="ForeignGpuProcess"} 1.0' in text
            # it goes away
            shutil.rmtree(proc / "488")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3:
                alerts = (await get("/v1/alerts"))["alerts"]
                if not [a for a in alerts if a["alertname"] == "ForeignGpuProcess" and a["state"] == "firing"]:
                    break
                await asyncio.sleep(0.05)
            assert time.monotonic() - t0 <= 2.0
    finally:
        if d._stop is not None:
            d._stop.set()
        else:
            task.cancel()
        assert await asyncio.wait_for(task, 30) == 0
