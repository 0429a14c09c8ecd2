"""`zerod top --once [--json]`: what the dashboard would show, printed once, without
a terminal (scripts, cron, support tickets), in the manner of `nvitop -1`.

One snapshot, from the daemon or (no daemon) from this host (standalone mode).
Text: the status line, GPUs, engines, GPU processes, alerts and the checks that do
not pass, each line cut to the width (the terminal's, else COLUMNS, else 120).
JSON: one document with `gpus`, `processes`, `engines`, `alerts`, `checks`, and
where it came from.
"""

from __future__ import annotations

import json
import shutil
import time
from typing import IO, Any, Callable

from rich.console import Console
from rich.text import Text

from zerod.tui import format as fmt
from zerod.tui import process_view as pv
from zerod.tui.client import ControlClient, DaemonUnreachable, Snapshot
from zerod.tui.widgets.fit import PAD, cell_len, widths
from zerod.tui.widgets.preflight import preflight_text
from zerod.tui.widgets.banner import START_HINT
from zerod.tui.widgets.engines import engine_line
from zerod.tui.widgets.gpu import gpu_row_text

NARROW_BELOW = 100
FALLBACK_WIDTH = 120
SETTLE_S = 0.5  # standalone: between the two reads that measure host CPU %


def take(client: ControlClient, local: Callable[[float], Snapshot] | None, now: float,
         settle_s: float = SETTLE_S) -> tuple[Snapshot | None, str, str | None]:
    """(snapshot, source "daemon" or "standalone", the daemon's error or None). Standalone
    reads the host twice, `settle_s` apart: host CPU % is measured between two reads."""
    try:
        return client.snapshot(now=now), "daemon", None
    except DaemonUnreachable as exc:
        if local is None:
            return None, "none", str(exc)
        local(now)
        time.sleep(settle_s)
        return local(now), "standalone", str(exc)


def document(snap: Snapshot | None, source: str, error: str | None, socket_path: str) -> dict[str, Any]:
    """The --json document."""
    snap = snap or Snapshot({}, {}, {}, {}, {}, {})
    return {
        "source": source, "taken_at": snap.taken_at,
        "daemon": {"socket": socket_path, "reachable": source == "daemon", "error": error,
                   "endpoint_errors": snap.errors},
        "host": snap.status.get("host"), "version": snap.status.get("version"),
        "nvml": (snap.gpus.get("nvml") or None),
        "gpus": [g for g in (snap.gpus.get("gpus") or []) if isinstance(g, dict)],
        "processes": [p for p in (snap.processes.get("processes") or []) if isinstance(p, dict)],
        "engines": snap.engine_docs(),
        "alerts": [a for a in (snap.alerts.get("alerts") or []) if isinstance(a, dict)],
        "checks": snap.checks or None,
    }


def process_lines(procs: list[dict[str, Any]], width: int, now: float, several_engines: bool) -> list[Text]:
    narrow = width < NARROW_BELOW
    keys = ["pid", "tag", "gpu_mem", "command"] if narrow else \
        ["pid", "gpu", "tag", "user", "gpu_mem", "sm", "cpu", "rss", "time", "command"]
    rows = pv.sort_rows(procs, pv.DEFAULT_SORT, False, now)
    cells = []
    for p in rows:
        label, style = pv.tag(p, several_engines)
        values = {"pid": Text(str(p.get("pid")), justify="right"),
                  "gpu": fmt.NA if p.get("gpu") is None else str(p.get("gpu")), "tag": Text(label, style),
                  "user": str(p.get("user") or fmt.NA), "gpu_mem": fmt.bytes_h(p.get("gpu_memory_bytes")),
                  "sm": pv.sm(p), "cpu": pv.cpu(p), "rss": fmt.bytes_h(p.get("rss_bytes")),
                  "time": pv.elapsed(p, now), "command": pv.command(p)}
        cells.append([values[k] for k in keys])
    labels = [pv.BY_KEY[k].label for k in keys]
    ws = widths(labels, cells, keys.index("command"), width, flex_min=8)

    def line(items, style: str = "") -> Text:
        t = Text(no_wrap=True, overflow="ellipsis", style=style)
        for i, (k, c) in enumerate(zip(keys, items)):
            c = c if isinstance(c, Text) else Text(str(c))
            pad = " " * max(0, ws[i] - cell_len(c))
            if pv.BY_KEY[k].right:
                t.append(pad)
                t.append_text(c)
            else:
                t.append_text(c)
                if i < len(keys) - 1:
                    t.append(pad)
            if i < len(keys) - 1:
                t.append(" " * PAD)
        return t

    return [line(labels, "bold")] + [line(c) for c in cells]


def text_lines(snap: Snapshot | None, source: str, error: str | None, socket_path: str,
               width: int, now: float, start_hint: str) -> list[Text]:
    out: list[Text] = []
    narrow = width < NARROW_BELOW
    if snap is None:
        return [Text(f"zerod top: cannot reach the daemon at {socket_path}: {error}", "bold red")]
    st = snap.status
    head = Text(no_wrap=True, overflow="ellipsis")
    head.append(f"zerod top · {st.get('host') or '?'} · zerod {st.get('version') or '?'} · ", "bold")
    head.append(fmt.utc(snap.taken_at))
    out.append(head)
    if source == "standalone":
        out.append(Text(f"the zerod daemon is not running ({socket_path}: {error})", "bold yellow"))
        out.append(Text(f"start it: {start_hint}", "bold"))
        out.append(Text("this host read directly: GPUs, GPU processes, doctor's last report; "
                        "no engine figures, no alerts", "dim"))
    nvml = snap.gpus.get("nvml") or {}
    gpus = [g for g in (snap.gpus.get("gpus") or []) if isinstance(g, dict)]
    out.append(Text(f"\nGPUs ({len(gpus)})" + (f" · driver {nvml.get('driver_version')}" if nvml.get("ok") else ""),
                    "bold underline"))
    if nvml and not nvml.get("ok"):
        out.append(Text(f"no NVIDIA GPU to show: {nvml.get('error') or 'NVML unavailable'}", "bold red"))
    for g in gpus:
        t = Text(f"GPU {g.get('index', '?')}  ", "bold", no_wrap=True, overflow="ellipsis")
        t.append_text(gpu_row_text(g, narrow))
        out.append(t)
    docs = snap.engine_docs()
    if docs:
        out.append(Text(f"\nEngines ({len(docs)})", "bold underline"))
        for e in docs:
            t = engine_line({"name": "default", **e}, narrow)
            t.append(f"  · {e.get('running') if e.get('running') is not None else fmt.NA} run "
                     f"{e.get('waiting') if e.get('waiting') is not None else fmt.NA} wait · "
                     f"{fmt.rate(e.get('output_tokens_per_s'))} tok/s · ITL p99 {fmt.ms(e.get('itl_p99_s'))} · "
                     f"TTFT p99 {fmt.ms(e.get('ttft_p99_s'))}", "")
            out.append(t)
    procs = [p for p in (snap.processes.get("processes") or []) if isinstance(p, dict)]
    foreign = sum(1 for p in procs if p.get("role") == "foreign")
    out.append(Text(f"\nGPU processes ({len(procs)})" + (f" · {foreign} foreign" if foreign else ""),
                    "bold underline"))
    out += process_lines(procs, width, now, len(docs) > 1)
    alerts = [a for a in (snap.alerts.get("alerts") or []) if isinstance(a, dict)]
    firing = [a for a in alerts if a.get("state") == "firing"]
    if source == "daemon":
        out.append(Text(f"\nAlerts · {len(firing)} firing · {len(alerts) - len(firing)} resolved", "bold underline"))
        for a in firing:
            out.append(Text(f"● {a.get('severity') or '?'} {a.get('alertname') or '?'} "
                            f"({fmt.duration(now - (fmt.num(a.get('starts_at')) or now))}): {a.get('summary') or ''}",
                            "red", no_wrap=True, overflow="ellipsis"))
    out.append(Text("\nHost · preflight" if source == "daemon" else "\nHost · doctor's last report",
                    "bold underline"))
    if source == "standalone" and not snap.checks:
        out.append(Text("no doctor report yet: run `zerod doctor`", "dim"))
    else:
        for line in preflight_text(st, snap.checks, snap.gpus, now=now, narrow=narrow).split("\n"):
            line.no_wrap, line.overflow = True, "ellipsis"
            out.append(line)
    for line in out:  # one terminal line each: cut, never wrapped
        line.no_wrap, line.overflow = True, "ellipsis"
    return out


def width_of(out: IO[str]) -> int:
    return shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns


def print_once(client: ControlClient, local: Callable[[float], Snapshot] | None, *, as_json: bool,
               now: float, out: IO[str], start_hint: str = START_HINT, width: int | None = None,
               colour: bool = False) -> int:
    snap, source, error = take(client, local, now)
    if as_json:
        out.write(json.dumps(document(snap, source, error, client.socket_path), indent=1, default=str) + "\n")
        return 0 if snap is not None else 1
    width = width or width_of(out)
    console = Console(file=out, width=width, force_terminal=colour, no_color=not colour, highlight=False,
                      soft_wrap=False, emoji=False)
    for line in text_lines(snap, source, error, client.socket_path, width, now, start_hint):
        console.print(line, crop=True, no_wrap=True, overflow="ellipsis")
    return 0 if snap is not None else 1
