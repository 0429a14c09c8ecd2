"""One test's result and the whole `zerod diag` report: doctor's shape (`version`,
`host`, a list, `summary` with the exit code) with the list called `tests`, each
result carrying the figure it measured and the one it was held against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerod.checks.report import STATUSES, exit_code_of
from zerod.diag.catalogue import BY_ID


@dataclass
class Figure:
    value: float
    unit: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": round(self.value, 3), "unit": self.unit}


@dataclass
class DiagResult:
    id: str
    status: str
    gpu: int | None = None
    peer: int | None = None  # diag.p2p_bandwidth: the GPU copied to
    message: str = ""
    measured: Figure | None = None
    expected: Figure | None = None
    evidence: list[dict] = field(default_factory=list)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        assert self.id in BY_ID, self.id

    def to_dict(self) -> dict[str, Any]:
        t = BY_ID[self.id]
        return {"id": self.id, "title": t.title, "severity": t.severity, "gpu": self.gpu, "peer": self.peer,
                "status": self.status, "message": self.message,
                "measured": self.measured.to_dict() if self.measured else None,
                "expected": self.expected.to_dict() if self.expected else None,
                "evidence": self.evidence,
                "remediation": t.remediation if self.status in ("fail", "warn", "error") else "",
                "duration_s": round(self.duration_s, 3)}


def counts(tests: list[dict]) -> dict[str, int]:
    return {s: sum(1 for t in tests if t["status"] == s) for s in STATUSES}


def make_report(tests: list[DiagResult], host: dict[str, Any]) -> dict[str, Any]:
    from zerod import __version__

    rows = [t.to_dict() for t in tests]
    n = counts(rows)
    return {"version": __version__, "host": host, "tests": rows,
            "summary": {**n, "total": len(rows), "exit_code": exit_code_of(n)}}
