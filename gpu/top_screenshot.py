#!/usr/bin/env python3
"""Capture `zerod top` on a live daemon: run the dashboard headless (Textual's
App.run_test) attached to the daemon's control socket, let it poll a few times, and
save SVG screenshots plus the raw control-API data it showed.

    python3 gpu/top_screenshot.py /run/zerod/control.sock [--out DIR] [--polls 5]
                                 [--sizes 160x48,120x40,80x24] [--keys KEYS]

Meant for the device H200 while `zerod run` serves under load (gpu/top_capture.sh sets
that up; see docs/tui.md for the wheels Textual needs there). Writes, under --out
(default $OUT, else the current directory):
  zerod-top-h200-WxH.svg      the dashboard at each size (the first after --polls polls)
  zerod-top-h200-once.json    `zerod top --once --json` taken right after the first capture
  zerod-top-h200-once.txt     `zerod top --once` (160 columns) at the same moment
  zerod-top-h200-data.json    every endpoint as the dashboard last read it
  zerod-top-h200.txt          what happened (polls, errors, timings)
--keys: keys pressed before each capture, comma-separated Textual key names (e.g. `t` for
the process tree).
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
                  out: Path, name: str, log: list[str], keys: list[str]):
    from zerod.tui.app import ZerodTop

    app = ZerodTop(socket_path, interval=interval, timeout=2.0)
    t0 = time.monotonic()
    async with app.run_test(size=size) as pilot:
        deadline = t0 + polls * interval + 20.0
        while app.polls < polls and time.monotonic() < deadline:
            await pilot.pause(0.1)
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.3)
        path = app.save_screenshot(filename=f"{name}.svg", path=str(out))
        log.append(f"{size[0]}x{size[1]}: {app.polls} polls in {time.monotonic() - t0:.1f}s; "
                   f"last error: {app.error or 'none'}; ok: {app.last_ok is not None}; saved {path}")
        snap = app.snapshot
    return snap


def once(socket_path: str, out: Path, log: list[str]) -> None:
    """`zerod top --once --json` and `--once` (160 columns), right after the first capture."""
    from zerod.tui.client import ControlClient
    from zerod.tui.local_source import LocalSource
    from zerod.tui.once import print_once

    local = LocalSource().snapshot
    for name, as_json in (("zerod-top-h200-once.json", True), ("zerod-top-h200-once.txt", False)):
        with open(out / name, "w") as f:
            code = print_once(ControlClient(socket_path), local, as_json=as_json, now=time.time(), out=f,
                              width=160)
        log.append(f"{name}: exit {code} at {time.strftime('%H:%M:%S', time.gmtime())} UTC")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket", nargs="?", default="/run/zerod/control.sock")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--polls", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--sizes", default="160x48,120x40,80x24")
    ap.add_argument("--keys", default="")
    args = ap.parse_args(argv)
    try:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
        assert sizes and all(len(s) == 2 and s[0] >= 80 and s[1] >= 24 for s in sizes)
    except (ValueError, AssertionError):
        ap.error(f"--sizes takes WxH,WxH,... of at least 80x24, got {args.sizes!r}")
    keys = [k for k in args.keys.split(",") if k]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import textual
    except ImportError:
        print("textual is not importable: install the wheels of docs/tui.md first", file=sys.stderr)
        return 2
    log = [f"socket {args.socket}; textual {textual.__version__}; python {sys.version.split()[0]}"]
    snap = None
    for i, (w, h) in enumerate(sizes):
        got = asyncio.run(capture(args.socket, (w, h), args.polls if i == 0 else 2, args.interval, out,
                                  f"zerod-top-h200-{w}x{h}", log, keys))
        snap = snap or got
        if i == 0:
            once(args.socket, out, log)
    if snap is not None:
        data = {"taken_at": snap.taken_at, "errors": snap.errors, "status": snap.status,
                "checks": snap.checks, "gpus": snap.gpus, "processes": snap.processes,
                "alerts": snap.alerts, "engine": snap.engine, "engines": snap.engines}
        (out / "zerod-top-h200-data.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "zerod-top-h200.txt").write_text("\n".join(log) + "\n")
    print("\n".join(log))
    return 0 if snap is not None else 1


if __name__ == "__main__":
    sys.exit(main())
