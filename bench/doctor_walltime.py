"""Wall time of `zerod doctor --json`, end to end (a fresh Python each run, as a user
runs it). Prints median/min/max; --out writes the runs as JSON.

    .venv/bin/python -m zerod.bench.doctor_walltime [-n 15] [--out FILE] [-- doctor args]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# Run from the checkout this file is in (so its zerod is the one timed); installed, from
# wherever the caller is.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = _CHECKOUT if os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml")) else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--out")
    ap.add_argument("doctor_args", nargs="*")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "zerod", "doctor", "--json", *a.doctor_args]
    subprocess.run(cmd, cwd=ROOT, capture_output=True)  # warm the page cache and .pyc files
    runs, codes = [], set()
    for _ in range(a.n):
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        runs.append(time.perf_counter() - t)
        codes.add(p.returncode)
        json.loads(p.stdout)  # each run printed one valid JSON object
        if "Traceback" in p.stderr:
            print(p.stderr, file=sys.stderr)
            return 1
    res = {"cmd": " ".join(cmd[1:]), "n": a.n, "median_s": statistics.median(runs), "min_s": min(runs),
           "max_s": max(runs), "runs_s": [round(r, 4) for r in runs], "exit_codes": sorted(codes),
           "host": platform.node(), "cpus": os.cpu_count(), "load": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime())}
    print(f"zerod doctor --json: median {res['median_s']:.3f} s, min {res['min_s']:.3f} s, "
          f"max {res['max_s']:.3f} s over {a.n} runs (exit {res['exit_codes']}, load {res['load'][0]:.2f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
