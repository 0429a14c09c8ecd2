"""Human output: grouped by area, one line per check, the fix under each problem,
a summary line. Fits 80 columns; colour only where the caller allows it."""

from __future__ import annotations

import textwrap

from .report import Report

AREAS = {"gpu": "GPU", "kernel": "Kernel", "numa": "NUMA", "mem": "Memory", "cpu": "CPU",
         "net": "Network", "engine": "Engine"}
LABEL = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip", "error": "ERR"}
COLOUR = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "bright_black", "error": "magenta"}
WIDTH = 80


def render(report: Report, colour: bool = False, verbose: bool = False) -> str:
    def style(text: str, status: str, bold: bool = False) -> str:
        if not colour:
            return text
        import click

        return click.style(text, fg=COLOUR[status], bold=bold)

    h = report.host
    lines = [f"zerod doctor {report.version} - {h.get('hostname', '?')}, kernel {h.get('kernel') or '?'}"
             + (f", {h['time']}" if h.get("time") else "")]
    if h.get("facts_file"):
        lines.append(f"(replayed from {h['facts_file']})")
    idw = max((len(c.id) for c in report.checks), default=20)
    idw = min(idw, 26)
    indent = " " * (2 + 4 + 1)
    area = None
    shown: dict[str, str] = {}  # a fix already printed -> the check it was printed under
    for c in report.checks:
        if c.area != area:
            area = c.area
            lines.append("")
            lines.append(AREAS.get(area, area))
        head = f"  {LABEL[c.status]:<4} {c.id:<{idw}} "
        body = textwrap.wrap(c.message or c.title, WIDTH - len(head), break_on_hyphens=False) or [""]
        lines.append("  " + style(f"{LABEL[c.status]:<4}", c.status, c.status in ("fail", "error"))
                     + f" {c.id:<{idw}} " + body[0])
        for more in body[1:]:
            lines.append(" " * len(head) + more)
        if c.remediation and c.status in ("fail", "warn", "error") and c.remediation in shown:
            lines.append(f"{indent}fix: as for {shown[c.remediation]} above")
        elif c.remediation and c.status in ("fail", "warn", "error"):
            shown[c.remediation] = c.id
            lines.extend(textwrap.wrap(c.remediation, WIDTH, initial_indent=indent + "fix: ",
                                       subsequent_indent=indent + "     ", break_on_hyphens=False))
        if verbose:
            for e in c.evidence:
                v = e.get("error") or e.get("value")
                lines.extend(textwrap.wrap(f"{e['name']} = {v} ({e.get('source', '')})", WIDTH,
                                           initial_indent=indent + "- ", subsequent_indent=indent + "  "))
    n = report.counts
    summary = (f"{len(report.checks)} checks: {n['pass']} ok, {n['warn']} warn, {n['fail']} fail, "
               f"{n['skip']} skipped, {n['error']} errors")
    if report.waived:
        summary += f" ({len(report.waived)} waived)"
    worst = "fail" if n["fail"] else ("warn" if n["warn"] or n["error"] else "pass")
    lines += ["", style(summary + f" -> exit {report.exit_code}", worst, True)]
    return "\n".join(lines)
