#!/usr/bin/env python3
"""Capture `zerod top` on a live daemon: run the dashboard headless (Textual's
App.run_test) attached to the daemon's control socket, let it poll a few times, and
save SVG screenshots plus the raw control-API data it showed.

    python3 gpu/top_screenshot.py /run/zerod/control.sock [--out DIR] [--polls 5]

Meant for the device H200 while `zerod run` serves under load (the coordinator runs
it; see docs/tui.md for the wheels Textual needs there). Writes, under --out
(default $OUT, else the current directory):
  zerod-top-h200-120x40.svg   the dashboard at 120×40
  zerod-top-h200-80x24.svg    the same at 80×24
  zerod-top-h200-data.json    every endpoint as the dashboard last read it
  zerod-top-h200.txt          what happened (polls, errors, timings)
Exit 0 when the daemon answered at least once, 1 when it never did (the screenshots
then show the "cannot reach the daemon" banner), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a plain checkout: zerod/__init__ maps tui/ to zerod.tui


async def capture(socket_path: str, size: tuple[int, int], polls: int, interval: float,
                  out: Path, name: str, log: list[str]):
    from zerod.tui.app import ZerodTop

    app = ZerodTop(socket_path, interval=interval, timeout=2.0)
    t0 = time.monotonic()
    async with app.run_test(size=size) as pilot:
        deadline = t0 + polls * interval + 20.0
        while app.polls < polls and time.monotonic() < deadline:
            await pilot.pause(0.1)
        await pilot.pause(0.3)
        path = app.save_screenshot(filename=f"{name}.svg", path=str(out))
        log.append(f"{size[0]}x{size[1]}: {app.polls} polls in {time.monotonic() - t0:.1f}s; "
                   f"last error: {app.error or 'none'}; ok: {app.last_ok is not None}; saved {path}")
        snap = app.snapshot
    return snap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket", nargs="?", default="/run/zerod/control.sock")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--polls", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import textual
    except ImportError:
        print("textual is not importable: install the wheels of docs/tui.md first", file=sys.stderr)
        return 2
    log = [f"socket {args.socket}; textual {textual.__version__}; python {sys.version.split()[0]}"]
    snap = asyncio.run(capture(args.socket, (120, 40), args.polls, args.interval, out,
                               "zerod-top-h200-120x40", log))
    asyncio.run(capture(args.socket, (80, 24), 2, args.interval, out, "zerod-top-h200-80x24", log))
    if snap is not None:
        data = {"taken_at": snap.taken_at, "errors": snap.errors, "status": snap.status,
                "checks": snap.checks, "gpus": snap.gpus, "processes": snap.processes,
                "alerts": snap.alerts, "engine": snap.engine}
        (out / "zerod-top-h200-data.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "zerod-top-h200.txt").write_text("\n".join(log) + "\n")
    print("\n".join(log))
    return 0 if snap is not None else 1


if __name__ == "__main__":
    sys.exit(main())
