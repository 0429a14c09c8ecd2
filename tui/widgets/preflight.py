"""Host and preflight summary: counts, then the checks that did not pass, failing first,
each with its evidence and fix."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.containers import VerticalScroll
from zerod.tui.widgets.line import Line

from zerod.tui import format as fmt

ORDER = {"fail": 0, "error": 1, "warn": 2}
MARK = {"fail": ("✗", "bold red"), "error": ("!", "bold magenta"), "warn": ("⚠", "bold yellow"),
        "pass": ("✓", "green"), "skip": ("·", "dim")}


def problems(checks: dict[str, Any]) -> list[dict[str, Any]]:
    items = [c for c in (checks.get("checks") or []) if isinstance(c, dict) and c.get("status") in ORDER]
    return sorted(items, key=lambda c: ORDER[c["status"]])


def preflight_text(status: dict[str, Any], checks: dict[str, Any], gpus: dict[str, Any], *,
                   now: float, narrow: bool) -> Text:
    t = Text()
    host = status.get("host") or checks.get("host") or "?"
    if isinstance(host, dict):  # doctor's report: {"hostname", "kernel", …}
        host = host.get("hostname") or "?"
    t.append(str(host), "bold")
    nvml = gpus.get("nvml") or {}
    if nvml.get("ok"):
        t.append(f" · driver {nvml.get('driver_version') or fmt.NA}", "dim")
    elif nvml:
        t.append(f" · NVML: {nvml.get('error') or 'unavailable'}", "bold red")
    engine = status.get("engine") or {}
    if not narrow and engine.get("numa_node") is not None:
        t.append(f" · engine on NUMA {engine.get('numa_node')} cpus {engine.get('cpus') or fmt.NA}", "dim")
    t.append("\n")
    pre = status.get("preflight") or checks.get("summary") or {}
    t.append("preflight ")
    for key in ("fail", "error", "warn", "pass", "skip"):
        n = pre.get(key)
        if not isinstance(n, int) or (n == 0 and key in ("error", "skip")):
            continue
        mark, style = MARK[key]
        t.append(f"{mark}{n} {key} ", style if n else "dim")
    taken = pre.get("taken_at", checks.get("taken_at"))
    if taken is not None:
        t.append(f"({fmt.ago(taken, now)})", "dim")
    _diag(t, status.get("diag"), now)
    bad = problems(checks)
    if not bad and pre:
        t.append("\nall checks pass", "green")
    for c in bad:
        mark, style = MARK[c["status"]]
        t.append(f"\n{mark} ", style)
        t.append(str(c.get("id", "?")), style)
        if not narrow and c.get("title"):
            t.append(f"  {c['title']}")
        if c.get("remediation"):
            t.append("\n    fix: ", "bold")
            t.append(str(c["remediation"]), "cyan")
        detail = str(c.get("message") or fmt.evidence_text(c.get("evidence")))
        if detail and not narrow:
            if len(detail) > 240:
                detail = detail[:239] + "…"
            t.append(f"\n    {detail}", "dim")
    return t


def _diag(t: Text, diag: Any, now: float) -> None:
    """The daemon's last `zerod diag` (/v1/status's `diag`): its level, counts and age."""
    if not isinstance(diag, dict):
        return
    if diag.get("running"):
        t.append("\ndiag running…", "bold")
        return
    last = diag.get("last")
    if not isinstance(last, dict):
        if diag.get("last_error"):
            t.append(f"\ndiag: {diag['last_error']}", "bold red")
        return
    t.append(f"\ndiag {last.get('level') or '?'} ")
    for key in ("fail", "error", "warn", "pass", "skip"):
        n = last.get(key)
        if isinstance(n, int) and (n or key in ("fail", "pass")):
            mark, style = MARK[key]
            t.append(f"{mark}{n} {key} ", style if n else "dim")
    if last.get("started_at") is not None:
        t.append(f"({fmt.ago(last['started_at'], now)})", "dim")


class PreflightPanel(VerticalScroll):
    def compose(self):
        yield Line("waiting for the daemon…", id="preflight-text")

    def show(self, status, checks, gpus, *, now: float, narrow: bool) -> None:
        self.query_one("#preflight-text", Line).set(
            preflight_text(status, checks, gpus, now=now, narrow=narrow), layout=True)
        bad = problems(checks)
        self.set_class(any(c["status"] == "fail" for c in bad), "-failing")
