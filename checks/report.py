"""The check registry, the result of each check, and the report with its exit code."""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .config import DoctorConfig
from .facts import Facts

STATUSES = ("pass", "warn", "fail", "skip", "error")
# Stable IDs, in the order the report shows them (the catalogue of docs/checks.md).
CATALOGUE = (
    "gpu.driver_loaded", "gpu.compute_capability", "gpu.driver_version", "gpu.cuda_compat",
    "gpu.persistence_mode", "gpu.ecc_health", "gpu.recovery_action", "gpu.firmware", "gpu.pcie_link",
    "gpu.clock_events", "gpu.mig_mode", "gpu.compute_mode", "gpu.fabric_manager",
    "gpu.nvlink", "gpu.p2p",
    "gpu.foreign_processes", "gpu.memory_headroom", "gpu.xid_recent",
    "gpu.count", "gpu.stuck_processes", "gpu.diag",
    "kernel.version", "kernel.io_uring", "kernel.numa_balancing", "numa.gpu_affinity",
    "host.iommu", "host.container_runtime", "host.disk_space",
    "mem.memlock", "mem.transparent_hugepages", "mem.swap", "cpu.governor", "net.bind_exposure",
    "engine.config",
)
BUG_FIX = "this is a bug in zerod: please report it with the snapshot from `zerod doctor --save-facts FILE`"


@dataclass
class CheckResult:
    id: str
    title: str
    status: str
    severity: str
    message: str = ""
    evidence: list[dict] = field(default_factory=list)
    remediation: str = ""

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "status": self.status, "severity": self.severity,
                "message": self.message, "evidence": self.evidence, "remediation": self.remediation}


@dataclass
class Check:
    id: str
    title: str
    severity: str  # critical: the engine cannot run or runs wrong; major: latency/throughput; minor
    fn: Callable[["Ctx"], tuple[str, str, str]]


REGISTRY: dict[str, Check] = {}


def check(id: str, title: str, severity: str):
    assert id in CATALOGUE, id
    assert severity in ("critical", "major", "minor"), severity

    def deco(fn):
        REGISTRY[id] = Check(id, title, severity, fn)
        return fn

    return deco


# What a check function returns: (status, message, remediation).
def PASS(msg: str) -> tuple[str, str, str]:
    return "pass", msg, ""


def WARN(msg: str, fix: str) -> tuple[str, str, str]:
    return "warn", msg, fix


def FAIL(msg: str, fix: str) -> tuple[str, str, str]:
    return "fail", msg, fix


def SKIP(msg: str) -> tuple[str, str, str]:
    return "skip", msg, ""


class Unavailable(Exception):
    """A fact the check needs could not be read: skip if absent on this host, else error."""

    def __init__(self, key: str, error: str, missing: bool) -> None:
        super().__init__(error)
        self.key, self.error, self.missing = key, error, missing


class CheckFailed(Exception):
    """Raised from helpers to fail the check at once (e.g. no NVIDIA driver)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.message, self.fix = message, fix


class Ctx:
    """What a check sees: the facts, the config, and an evidence list it fills."""

    def __init__(self, facts: Facts, cfg: DoctorConfig) -> None:
        self.facts, self.cfg = facts, cfg
        self.evidence: list[dict] = []

    def fact(self, key: str, record: bool = True) -> Any:
        f = self.facts.get(key)
        if not f.ok:
            raise Unavailable(key, f.error or "unreadable", f.missing)
        if record:
            self.ev(key, f.value, f.source)
        return f.value

    def optional(self, key: str, default: Any = None, record: bool = True) -> Any:
        f = self.facts.get(key)
        if not f.ok:
            if record and f.key in self.facts:
                self.ev(key, None, f.source, error=f.error)
            return default
        if record:
            self.ev(key, f.value, f.source)
        return f.value

    def ev(self, name: str, value: Any, source: str = "", error: str | None = None) -> None:
        e = {"name": name, "value": value, "source": source}
        if error:
            e["error"] = error
        self.evidence.append(e)


class UnknownCheck(ValueError):
    """--only/--skip named something no check matches (an operator's typo)."""

    def __init__(self, pattern: str, ids: list[str]) -> None:
        names = ids + sorted({i.split(".")[0] for i in ids})
        self.pattern = pattern
        self.closest = difflib.get_close_matches(pattern, names, n=3, cutoff=0.0)
        super().__init__(f"no check matches {pattern!r}; closest: {', '.join(self.closest)} "
                         f"(`zerod doctor --json` lists every ID)")


def _select(ids: list[str], patterns: Iterable[str] | None) -> set[str]:
    """IDs matched by patterns: an exact ID, an area ('gpu'), or a glob ('gpu.*')."""
    out: set[str] = set()
    for pat in patterns or ():
        for p in (s.strip() for s in pat.split(",")):
            if not p:
                continue
            hit = {i for i in ids if i == p or i.split(".")[0] == p or fnmatch.fnmatch(i, p)}
            if not hit:
                raise UnknownCheck(p, ids)
            out |= hit
    return out


def select_checks(only: Iterable[str] | None = None, skip: Iterable[str] | None = None) -> set[str]:
    """The IDs --only/--skip leave to run; UnknownCheck for a pattern that matches none."""
    ids = [i for i in CATALOGUE if i in REGISTRY]
    chosen = _select(ids, only) if only else set(ids)
    return chosen - (_select(ids, skip) if skip else set())


def exit_code_of(counts: dict[str, int]) -> int:
    """0 all pass (skips allowed), 1 warnings only (a check that could not run
    counts as a warning), 2 any failure. `zerod diag` exits by the same rule."""
    if counts.get("fail"):
        return 2
    if counts.get("warn") or counts.get("error"):
        return 1
    return 0


@dataclass
class Report:
    checks: list[CheckResult]
    host: dict[str, Any] = field(default_factory=dict)
    waived: dict[str, str] = field(default_factory=dict)  # id -> reason, for waived checks
    version: str = ""

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in STATUSES}

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.counts)

    def failing(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "host": self.host,
            "checks": [c.to_dict() for c in self.checks],
            "summary": {**self.counts, "total": len(self.checks), "exit_code": self.exit_code,
                        "waived": self.waived},
        }


def run_checks(facts: Facts, config: DoctorConfig | None = None, only: Iterable[str] | None = None,
               skip: Iterable[str] | None = None) -> Report:
    """Run the catalogue over a snapshot. A check that raises becomes `error`; the
    others still run. Waived checks (config.waivers) report `skip` with what they found."""
    from zerod import __version__

    cfg = config or DoctorConfig()
    ids = [i for i in CATALOGUE if i in REGISTRY]
    chosen = select_checks(only, skip)
    unknown_waivers = sorted(set(cfg.waivers) - set(ids))
    results: list[CheckResult] = []
    waived: dict[str, str] = {}
    for cid in ids:
        if cid not in chosen:
            continue
        chk = REGISTRY[cid]
        ctx = Ctx(facts, cfg)
        try:
            status, msg, fix = chk.fn(ctx)
        except CheckFailed as exc:
            status, msg, fix = "fail", exc.message, exc.fix
        except Unavailable as exc:
            status = "skip" if exc.missing else "error"
            msg, fix = exc.error, ("" if exc.missing else "run doctor as root, or fix the access to "
                                   + (facts.get(exc.key).source or exc.key))
        except Exception as exc:  # noqa: BLE001 - never a traceback: the check reports it
            status, msg, fix = "error", f"check raised {type(exc).__name__}: {exc}", BUG_FIX
        if cid in cfg.waivers and status in ("fail", "warn", "error"):
            waived[cid] = cfg.waivers[cid]
            msg = f"waived ({cfg.waivers[cid]}); found {status}: {msg}"
            status = "skip"
        results.append(CheckResult(cid, chk.title, status, chk.severity, msg, ctx.evidence, fix))
    host = dict(facts.host)
    if unknown_waivers:
        host["unknown_waivers"] = unknown_waivers
    return Report(results, host, waived, __version__)
