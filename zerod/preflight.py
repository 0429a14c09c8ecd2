"""The preflight gate: `zerod doctor`'s checks (same code, same config) before
the engine starts, and again every `recheck_interval_s` while it serves.

A failing check that is not waived refuses the start (`PreflightRefused`, exit
78): the refusal names each fix once with the checks it covers. A re-check
never stops the engine; it raises or resolves `PreflightFailed`. The last
report is kept for /v1/checks, /v1/status and `zerod_check_status`.

With several engines ([[engines]]) each has a Preflight of its own: the checks
judge its GPUs, its model and its flags; a refusal names the engine, and its
PreflightFailed alerts and check series carry its name.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from zerod import __version__
from zerod.alerts import AlertBook
from zerod.checks import last_report, probe_facts, run_checks
from zerod.checks.config import DoctorConfig
from zerod.checks.report import CATALOGUE, CheckResult, Report
from zerod.fleet import DEFAULT_NAME, EngineSpec
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher

log = logging.getLogger("zerod.preflight")

# With --demo these are waived: a CPU-only machine fails them by design.
DEMO_WAIVER = "--demo runs the demo model without a GPU"
# Re-checks while the engine runs skip what only means something before it starts
# (its own memory fills the GPU) or what a watcher already follows every second.
RECHECK_SKIP = ("gpu.memory_headroom", "gpu.foreign_processes")
CHECK_STATUS_VALUE = {"pass": 0, "skip": 0, "warn": 1, "error": 1, "fail": 2}


class PreflightRefused(Exception):
    pass


def demo_waivable(check_id: str) -> bool:
    return check_id.startswith("gpu.") or check_id == "numa.gpu_affinity"


def refusal_text(failing: list[CheckResult], demo: bool) -> str:
    """Grouped by fix: each fix once, under the checks it covers; checks that
    found the same thing share a line."""
    groups: dict[str, dict[str, list[str]]] = {}  # fix -> message -> check ids
    for x in failing:
        groups.setdefault(x.remediation or "", {}).setdefault(x.message, []).append(x.id)
    lines = [f"refusing to start: {len(failing)} preflight check(s) fail"]
    for fix, by_message in groups.items():
        for message, ids in by_message.items():
            lines.append(f"  {', '.join(ids)}: {message}")
        lines.append(f"    fix: {fix}" if fix else "    fix: see `zerod doctor` for what it found")
    lines.append('  to start anyway, waive a check on purpose: [doctor.waivers] "<check id>" = "why"')
    if not demo and any(demo_waivable(x.id) for x in failing):
        lines.append("  no GPU here? `zerod run --demo` serves the demo model on the CPU, GPU checks waived")
    return "\n".join(lines)


CHECK_STATUS = "zerod_check_status"


@owns(metrics=(CHECK_STATUS,),
      alerts=(AlertRule("PreflightFailed", "warning", "a doctor check fails at the periodic re-check or after an "
                        "address change (critical for a critical check)"),))
class Preflight:
    def __init__(self, config: dict[str, dict[str, Any]], book: AlertBook, *, enabled: bool = True,
                 demo: bool = False, api_key_set: bool = False, host: str = "",
                 spec: EngineSpec | None = None) -> None:
        self.spec = spec or EngineSpec(DEFAULT_NAME, (), {})
        if self.spec.tagged:  # this engine's flags and GPUs, not the shared [engine] table's
            doctor = {**(config.get("doctor") or {}), "gpus": list(self.spec.gpus),
                      "engine_env": {**((config.get("daemon") or {}).get("engine_env") or {}), **self.spec.env}}
            config = {**config, "engine": self.spec.flags(), "doctor": doctor}
        cfg = DoctorConfig.from_config(config)
        if api_key_set:  # a systemd credential, not [engine] api_key
            cfg = dataclasses.replace(cfg, api_key_set=True)
        if demo:
            extra = {cid: DEMO_WAIVER for cid in CATALOGUE if demo_waivable(cid) and cid not in cfg.waivers}
            cfg = dataclasses.replace(cfg, waivers={**cfg.waivers, **extra})
        self.doctor = cfg
        self.book = book
        self.enabled = enabled
        self.demo = demo
        self.host = host
        self.report: Report | None = None
        self.taken_at: float | None = None

    def _run(self, skip: tuple[str, ...] | None) -> Report:
        report = run_checks(probe_facts(config=self.doctor), config=self.doctor, skip=skip)
        self.report, self.taken_at = report, time.time()
        if not self.demo:  # for `zerod top` once the daemon is gone; best effort
            last_report.save(report.to_dict(), self.taken_at)
        return report

    def gate(self) -> None:
        """The first run; raises PreflightRefused on a failing check."""
        if not self.enabled:
            log.warning("preflight disabled ([daemon] preflight = false): starting without checks")
            return
        t0 = time.monotonic()
        report = self._run(skip=None)
        c = report.counts
        log.info("preflight: %d pass, %d warn, %d fail, %d skip, %d error in %.0f ms",
                 c["pass"], c["warn"], c["fail"], c["skip"], c["error"], (time.monotonic() - t0) * 1000)
        self._log_waivers(report)
        for x in report.checks:
            if x.status in ("warn", "error"):
                log.warning("preflight: %s %s: %s", x.id, x.status, x.message)
        failing = report.failing()
        if failing:
            text = refusal_text(failing, self.demo)
            raise PreflightRefused(text.replace("refusing to start:", f"refusing to start engine {self.spec.name}:", 1)
                                   if self.spec.tagged else text)

    def _log_waivers(self, report: Report) -> None:
        demo_waived = sorted(k for k, v in report.waived.items() if v == DEMO_WAIVER)
        if demo_waived:
            found: list[str] = []
            for x in report.checks:
                if x.id in demo_waived and x.message:
                    m = x.message.split("; found ", 1)[-1]
                    if m not in found and "see gpu.driver_loaded" not in m:
                        found.append(m)
            log.warning("preflight: --demo waives the GPU checks (%s); they found: %s",
                        ", ".join(demo_waived), " | ".join(found)[:600] or "nothing")
        for cid, why in sorted(report.waived.items()):
            if why != DEMO_WAIVER:
                log.warning("preflight: %s waived in [doctor] waivers (%s)", cid, why)

    def recheck(self) -> None:
        """Run again while serving: PreflightFailed fires or resolves, nothing stops."""
        failing = self._run(skip=RECHECK_SKIP).failing()
        self.book.sync("PreflightFailed", {self.spec.key(x.id): _alert(x, self.spec) for x in failing})

    def recheck_bind_exposure(self) -> None:
        """`net.bind_exposure` alone, on fresh addresses (an address came or went):
        its row of the last report is replaced; PreflightFailed fires or resolves for it."""
        from zerod.checks import probe_net
        from zerod.checks.facts import Facts

        facts = Facts()
        probe_net.probe(facts)
        [x] = run_checks(facts, config=self.doctor, only=["net.bind_exposure"]).checks
        if self.report is not None:
            self.report.checks = [x if c.id == x.id else c for c in self.report.checks]
        if x.status == "fail":
            log.warning("net.bind_exposure fails after an address change: %s", x.message)
            self.book.fire("PreflightFailed", self.spec.key(x.id), **_alert(x, self.spec))
        else:
            self.book.resolve("PreflightFailed", self.spec.key(x.id))

    # --- what the outputs read -------------------------------------------------
    def checks_doc(self) -> dict[str, Any]:
        if self.report is None:
            return {"version": __version__, "host": {"hostname": self.host}, "checks": [],
                    "summary": {}, "taken_at": None}
        return {**self.report.to_dict(), "taken_at": self.taken_at}

    def summary(self) -> dict[str, Any] | None:
        if self.report is None:
            return None
        return {**self.report.counts, "exit_code": self.report.exit_code, "taken_at": self.taken_at}

    def collect(self):
        cs = GaugeMetricFamily(CHECK_STATUS,
                               "Last preflight result per check: 0 pass or skip, 1 warn or error, 2 fail.",
                               labels=["check", *self.spec.labels])
        for c in self.report.checks if self.report else []:
            cs.add_metric([c.id, *self.spec.labels.values()], float(CHECK_STATUS_VALUE.get(c.status, 1)))
        yield cs


def _alert(x: CheckResult, spec: EngineSpec) -> dict[str, Any]:
    named = f" for engine {spec.name}" if spec.tagged else ""
    return dict(severity="critical" if x.severity == "critical" else "warning",
                summary=f"check {x.id} fails{named}: {x.title}", description=x.message,
                labels={"check": x.id, **spec.labels}, fix=x.remediation or None)


class RecheckWatcher(Watcher):
    name = "rechecks"
    delay_first = True  # the gate has just run

    def __init__(self, preflight: Preflight, interval_s: float) -> None:
        super().__init__()
        if preflight.spec.tagged:
            self.name = f"{self.name}:{preflight.spec.name}"
        self.preflight = preflight
        self.interval_s = interval_s

    def poll(self) -> None:
        self.preflight.recheck()
