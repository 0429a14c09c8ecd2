"""`zerod diag` as text: a line per test (doctor's labels), the fix under a problem."""

from __future__ import annotations

import textwrap
from typing import Any

from zerod.checks.render import LABEL, WIDTH


def render(report: dict[str, Any]) -> str:
    h = report["host"]
    lines = [f"zerod diag {report['version']} --level {h.get('level')} - {h.get('hostname', '?')}, "
             f"{h.get('time', '')}, {h.get('duration_s', 0):.1f} s"]
    for g in h.get("gpus") or []:
        spec = (g.get("spec") or {}).get("model")
        lines.append(f"  GPU {g['index']}: {g.get('name')}" + (f" (spec figures: {spec})" if spec else
                                                               " (no spec figures for this model)"))
    idw = max((len(t["id"]) for t in report["tests"]), default=20)
    for t in report["tests"]:
        where = "" if t["gpu"] is None else (f"gpu {t['gpu']}" + (f"->{t['peer']}" if t["peer"] is not None else ""))
        head = f"  {LABEL[t['status']]:<4} {t['id']:<{idw}} {where:<8} "
        body = textwrap.wrap(t["message"] or t["title"], max(30, WIDTH - len(head))) or [""]
        lines.append(head + body[0])
        lines.extend(" " * len(head) + more for more in body[1:])
        if t["remediation"]:
            lines.extend(textwrap.wrap("fix: " + t["remediation"], WIDTH, initial_indent=" " * 7,
                                       subsequent_indent=" " * 12))
    n = report["summary"]
    lines += ["", f"{n['total']} tests: {n['pass']} ok, {n['warn']} warn, {n['fail']} fail, {n['skip']} skipped, "
                  f"{n['error']} errors -> exit {n['exit_code']}"]
    return "\n".join(lines)
