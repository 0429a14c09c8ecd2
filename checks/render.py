"""Human output: grouped by area, one line per check, the fix under each problem,
a summary line. Fits 80 columns; colour only where the caller allows it."""

from __future__ import annotations

import textwrap

from .report import Report

AREAS = {"gpu": "GPU", "kernel": "Kernel", "numa": "NUMA", "host": "Host", "mem": "Memory", "cpu": "CPU",
         "net": "Network", "engine": "Engine"}
LABEL = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip", "error": "ERR"}
COLOUR = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "bright_black", "error": "magenta"}
WIDTH = 80


def _wrap(text: str, width: int) -> list[str]:
    """Wrap each line of `text`; a line starting with '- ' is a list item with a hanging indent."""
    out: list[str] = []
    for para in text.split("\n"):
        sub = "  " if para.startswith("- ") else ""
        out += textwrap.wrap(para, width, subsequent_indent=sub, break_on_hyphens=False) or [""]
    return out


def render(report: Report, colour: bool = False, verbose: bool = False) -> str:
    def style(text: str, status: str, bold: bool = False) -> str:
        if not colour:
            return text
        import click

        return click.style(text, fg=COLOUR[status], bold=bold)

    h = report.host
    head = (f"zerod doctor {report.version} - {h.get('hostname', '?')}, kernel {h.get('kernel') or '?'}"
            + (f", {h['time']}" if h.get("time") else ""))
    if h.get("facts_file"):
        head += f" (replayed from {h['facts_file']})"
    lines = textwrap.wrap(head, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
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
        body = _wrap(c.message or c.title, WIDTH - len(head)) or [""]
        lines.append("  " + style(f"{LABEL[c.status]:<4}", c.status, c.status in ("fail", "error"))
                     + f" {c.id:<{idw}} " + body[0])
        for more in body[1:]:
            lines.append(" " * len(head) + more)
        if c.remediation and c.status in ("fail", "warn", "error") and c.remediation in shown:
            lines.append(f"{indent}fix: as for {shown[c.remediation]} above")
        elif c.remediation and c.status in ("fail", "warn", "error"):
            shown[c.remediation] = c.id
            fix = _wrap(c.remediation, WIDTH - len(indent) - 5)
            lines.append(indent + "fix: " + fix[0])
            lines.extend(indent + "     " + more for more in fix[1:])
        if verbose:
            for e in c.evidence:
                v = e.get("error") or e.get("value")
                lines.extend(textwrap.wrap(f"{e['name']} = {v} ({e.get('source', '')})", WIDTH,
                                           initial_indent=indent + "- ", subsequent_indent=indent + "  "))
    n = report.counts
    summary = (f"{len(report.checks)} check{'s' if len(report.checks) != 1 else ''}: {n['pass']} ok, {n['warn']} warn, {n['fail']} fail, "
               f"{n['skip']} skipped, {n['error']} errors")
    if report.waived:
        summary += f" ({len(report.waived)} waived)"
    worst = "fail" if n["fail"] else ("warn" if n["warn"] or n["error"] else "pass")
    lines += ["", style(summary + f" -> exit {report.exit_code}", worst, True)]
    return "\n".join(lines)
