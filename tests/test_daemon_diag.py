"""The daemon's runs of `zerod diag`: `[daemon] diag_on_start` runs it on the engines'
GPUs before they start, and POST /v1/diag on request; the result is kept, served by
/v1/status and /v1/diag, exported on /metrics, and a failing test raises
GpuDiagFailed. A stand-in script plays `python -m zerod diag` (this host has no GPU):
it prints a report built by zerod.diag.report, as the real command does."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from test_daemon_fleet import fleet_config, until
from zerod.daemon import Daemon

STAND_IN = r'''
import json, sys, time
from zerod.diag.report import Figure, DiagResult, make_report
log = sys.argv[1]
with open(log, "a") as f:
    f.write(json.dumps({"argv": sys.argv[2:], "started": time.time()}) + "\n")
time.sleep(float(sys.argv[2]))
tests = [DiagResult("diag.gemm_bf16", "pass", 0, message="GEMM: 800 TFLOP/s",
                    measured=Figure(801.5, "TFLOP/s"), expected=Figure(989, "TFLOP/s")),
         DiagResult("diag.gemm_bf16", "fail", 1, message="the product is wrong (see the residuals)",
                    measured=Figure(790.0, "TFLOP/s"), expected=Figure(989, "TFLOP/s"))]
print(json.dumps(make_report(tests, {"level": "quick", "started_at": time.time(), "time": "now"})))
with open(log, "a") as f:
    f.write(json.dumps({"ended": time.time()}) + "\n")
sys.exit(2)
'''


def _runs(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def test_diag_on_start_before_the_engines_then_on_request(tmp_path):
    config = fleet_config(tmp_path)
    config["daemon"].update(diag_on_start=True, allow_write_actions=True, state_dir=str(tmp_path / "state"))
    script, log = tmp_path / "diag_stand_in.py", tmp_path / "diag_runs.jsonl"
    script.write_text(STAND_IN)
    d = Daemon(config, demo=True, diag_command=(sys.executable, str(script), str(log), "2.0"))
    task = asyncio.create_task(d.run())
    conn = aiohttp.UnixConnector(path=config["daemon"]["control_socket"])
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            async def call(path, method="GET", body=None):
                async with http.request(method, "http://zerod" + path, json=body) as r:
                    return r.status, await r.json()

            async def metrics():
                host, port = d.metrics_address
                async with aiohttp.ClientSession() as plain:
                    async with plain.get(f"http://{host}:{port}/metrics") as r:
                        return await r.text()

            await until(lambda: d.ready_at is not None, 40, "both engines healthy after the diag")
            [start, end] = _runs(log)
            assert end["ended"] > start["started"]
            assert start["argv"][1:] == ["--level", "quick", "--json", "--force", "--no-save", "--gpus", "0,1"]
            # no engine was spawned before the diag had ended (both times on the wall clock)
            assert min(s.fig.started_at for s in d.supervisors) > end["ended"]
            _, st = await call("/v1/status")
            assert st["diag"]["running"] is False
            assert {k: st["diag"]["last"][k] for k in ("level", "pass", "fail", "exit_code")} == \
                {"level": "quick", "pass": 1, "fail": 1, "exit_code": 2}
            kept = json.loads((tmp_path / "state" / "diag.json").read_text())
            assert [t["status"] for t in kept["tests"]] == ["pass", "fail"]
            alerts = (await call("/v1/alerts"))[1]["alerts"]
            [failed] = [a for a in alerts if a["alertname"] == "GpuDiagFailed" and a["state"] == "firing"]
            assert failed["severity"] == "critical" and failed["labels"]["gpu"] == "1"
            assert "diag.gemm_bf16 fail" in failed["summary"]
            text = await metrics()
            assert 'zerod_diag_test_status{gpu="1",peer="",test="diag.gemm_bf16"} 2.0' in text
            assert 'zerod_diag_test_status{gpu="0",peer="",test="diag.gemm_bf16"} 0.0' in text
            assert 'zerod_diag_measured{gpu="0",peer="",test="diag.gemm_bf16",unit="TFLOP/s"} 801.5' in text
            assert 'zerod_diag_expected{gpu="0",peer="",test="diag.gemm_bf16",unit="TFLOP/s"} 989.0' in text

            # on request: the engines serve on GPUs 0 and 1, so a run needs force
            code, body = await call("/v1/diag", "POST", {"level": "quick", "gpus": [1]})
            assert code == 409 and "engine b" in body["error"] and "serves on GPU 1" in body["error"]
            code, body = await call("/v1/diag", "POST", {"level": "quick", "gpu": [1]})
            assert code == 400 and "gpu" in body["error"]
            code, body = await call("/v1/diag", "POST", {"level": "slow"})
            assert code == 400 and "quick, full" in body["error"]
            code, body = await call("/v1/diag", "POST", {"level": "full", "gpus": [1], "force": True})
            assert code == 202 and body["running"]["gpus"] == [1]
            code, body = await call("/v1/diag", "POST", {"force": True})
            assert code == 409 and "still going" in body["error"]
            assert (await call("/v1/status"))[1]["diag"]["running"] is True
            await until(lambda: d.views.diag.running is None, 20, "the requested run to end")
            assert _runs(log)[2]["argv"][1:] == ["--level", "full", "--json", "--force", "--no-save", "--gpus", "1"]
            assert (await call("/v1/diag"))[1]["last"]["summary"]["fail"] == 1
    finally:
        d._on_signal(__import__("signal").SIGTERM)
        assert await asyncio.wait_for(task, 30) == 0


async def test_a_run_that_gives_no_report_is_logged_not_fatal(tmp_path):
    from zerod.alerts import AlertBook
    from zerod.diag.service import DiagService

    script = tmp_path / "broken.py"
    script.write_text("import sys; print('Traceback: boom', file=sys.stderr); sys.exit(1)\n")
    svc = DiagService(AlertBook(), str(tmp_path / "diag.json"), engines=lambda: [],
                      command=(sys.executable, str(script)))
    assert await svc.run("quick", [0]) is None
    assert svc.last is None and "no report: Traceback: boom" in svc.last_error
    assert svc.status() == {"running": False, "last": None, "last_error": svc.last_error}
