"""The daemon's runs of `zerod diag`: before the first engine start (`[daemon]
diag_on_start`) and on request through the control API (POST /v1/diag).

Each run is a child process (`python -m zerod diag --json`): the daemon itself
never creates a CUDA context. The last report is kept (zerod.diag.store) and
served from memory: /v1/diag, the `diag` field of /v1/status, and the
`zerod_diag_*` series of /metrics. A failing or warning test raises
`GpuDiagFailed` for its GPU; the next run's verdict resolves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any, Callable

from prometheus_client.core import GaugeMetricFamily

from zerod.alerts import AlertBook
from zerod.diag import busy, store
from zerod.diag.catalogue import LEVELS
from zerod.registry import AlertRule, owns
from zerod.preflight import CHECK_STATUS_VALUE  # zerod_diag_test_status uses zerod_check_status's scale

log = logging.getLogger("zerod.diag")

TIMEOUT_S = {"quick": 60.0, "full": 360.0}  # per GPU, with the child's start-up and torch's import
COMMAND = (sys.executable, "-m", "zerod", "diag")


class DiagRefused(Exception):
    """A run cannot start now (one already runs, or an engine serves on a GPU named)."""


def summary(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """What /v1/status shows of a report: when, which level, the counts."""
    if report is None:
        return None
    h = report.get("host") or {}
    return {"level": h.get("level"), "time": h.get("time"), "started_at": h.get("started_at"),
            "duration_s": h.get("duration_s"), **(report.get("summary") or {})}


@owns(metrics=("zerod_diag_test_status", "zerod_diag_measured", "zerod_diag_expected",
                "zerod_diag_last_run_timestamp_seconds", "zerod_diag_running"),
      alerts=(AlertRule("GpuDiagFailed", "critical", "a `zerod diag` test failed or warned on a GPU: "
                        "its figure against the spec, or a wrong answer"),))
class DiagService:
    def __init__(self, book: AlertBook, path: str, engines: Callable[[], list[dict[str, Any]]],
                 command: tuple[str, ...] = COMMAND) -> None:
        self.book = book
        self.path = path
        self.engines = engines  # each engine's /v1/status entry: name, gpus, state, pid, model
        self.command = tuple(command)
        self.last: dict[str, Any] | None = store.load(path)
        self.running: dict[str, Any] | None = None
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    # -- running ----------------------------------------------------------------------------
    def start(self, level: str, gpus: list[int] | None, force: bool) -> dict[str, Any]:
        """Start a run in the background (the control API's POST); DiagRefused says why not."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
        if self.running is not None:
            raise DiagRefused(f"a {self.running['level']} run started at {self.running['started_at']:.0f} "
                              f"is still going")
        if not force:
            every = sorted({g for e in self.engines() for g in e.get("gpus") or []})
            serving = busy.busy(self.engines(), gpus if gpus is not None else every)
            if serving:
                raise DiagRefused("; ".join(serving) + ": pass \"force\": true to test it anyway")
        self._mark(level, gpus)
        self._task = asyncio.get_running_loop().create_task(self.run(level, gpus), name="diag")
        return dict(self.running)

    def _mark(self, level: str, gpus: list[int] | None) -> None:
        self.running = {"level": level, "gpus": gpus, "started_at": time.time()}

    async def run(self, level: str, gpus: list[int] | None) -> dict[str, Any] | None:
        """One run to its end; the report, or None when the child gave none (logged)."""
        if self.running is None:
            self._mark(level, gpus)
        argv = [*self.command, "--level", level, "--json", "--force", "--no-save"]
        if gpus is not None:
            argv += ["--gpus", ",".join(map(str, gpus))]
        n = len(gpus) if gpus is not None else max(1, len({g for e in self.engines() for g in e.get("gpus") or []}))
        log.info("diag: running %s", " ".join(argv[2:]))
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S[level] * n)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                raise RuntimeError(f"no report within {TIMEOUT_S[level] * n:.0f} s: killed") from None
            try:
                report = json.loads(out)
            except ValueError:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"exit {proc.returncode}, no report: {tail[0][:300]}") from None
            self._keep(report)
            return report
        except asyncio.CancelledError:  # the daemon stops: the child goes with it
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        except Exception as exc:  # noqa: BLE001 - a failed run is logged and shown, never a daemon crash
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("diag: %s", self.last_error)
            return None
        finally:
            self.running = None

    def _keep(self, report: dict[str, Any]) -> None:
        self.last, self.last_error = report, None
        try:
            store.save(report, self.path)
        except OSError as exc:
            log.warning("diag: cannot keep the result in %s: %s", self.path, exc)
        n = report.get("summary") or {}
        log.info("diag: %s pass, %s warn, %s fail, %s skip, %s error", n.get("pass"), n.get("warn"),
                 n.get("fail"), n.get("skip"), n.get("error"))
        self._alerts(report)

    def _alerts(self, report: dict[str, Any]) -> None:
        bad: dict[str, list[dict]] = {}
        for t in report.get("tests") or []:
            if t["status"] in ("fail", "warn", "error"):
                bad.setdefault("" if t.get("gpu") is None else str(t["gpu"]), []).append(t)
        current = {}
        for gpu, tests in bad.items():
            worst = "critical" if any(t["status"] == "fail" for t in tests) else "warning"
            current[gpu] = dict(severity=worst, labels={"gpu": gpu or None},
                                summary=f"zerod diag on GPU {gpu or '?'}: "
                                        + ", ".join(f"{t['id']} {t['status']}" for t in tests),
                                description="; ".join(t["message"] for t in tests)[:1000],
                                fix=tests[0].get("remediation") or None)
        self.book.sync("GpuDiagFailed", current)

    async def close(self) -> None:
        """Stop a run in progress (the daemon stops)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- what the daemon serves -------------------------------------------------------------
    def doc(self) -> dict[str, Any]:
        """/v1/diag: the run in progress, the last report whole, where it is kept."""
        return {"running": self.running, "last": self.last, "last_error": self.last_error, "path": self.path}

    def status(self) -> dict[str, Any]:
        """The `diag` field of /v1/status."""
        return {"running": self.running is not None, "last": summary(self.last), "last_error": self.last_error}

    def collect(self):
        labels = ["test", "gpu", "peer"]
        status = GaugeMetricFamily("zerod_diag_test_status",
                                   "Last zerod diag result per test and GPU: 0 pass or skip, 1 warn or error, 2 fail.",
                                   labels=labels)
        measured = GaugeMetricFamily("zerod_diag_measured",
                                     "What the last zerod diag measured, in the test's unit.", labels=labels + ["unit"])
        expected = GaugeMetricFamily("zerod_diag_expected",
                                     "The spec figure the last zerod diag held each measurement against.",
                                     labels=labels + ["unit"])
        for t in (self.last or {}).get("tests") or []:
            lv = [t["id"], "" if t.get("gpu") is None else str(t["gpu"]),
                  "" if t.get("peer") is None else str(t["peer"])]
            status.add_metric(lv, float(CHECK_STATUS_VALUE.get(t["status"], 1)))
            for fam, key in ((measured, "measured"), (expected, "expected")):
                fig = t.get(key)
                if fig:
                    fam.add_metric(lv + [fig["unit"]], float(fig["value"]))
        yield from (status, measured, expected)
        started = ((self.last or {}).get("host") or {}).get("started_at")
        last_run = GaugeMetricFamily("zerod_diag_last_run_timestamp_seconds",
                                     "When the last zerod diag run started (Unix time).", labels=[])
        if started is not None:
            last_run.add_metric([], float(started))
        yield last_run
        yield GaugeMetricFamily("zerod_diag_running", "1 while a zerod diag run is going.",
                                value=1.0 if self.running is not None else 0.0)
