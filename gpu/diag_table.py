"""The short table of gpu/diag_check.sh: `zerod diag` quick and full beside the plain
torch reference, per GPU. Usage: diag_table.py QUICK.json FULL.json REFERENCE.jsonl"""

from __future__ import annotations

import json
import sys


def figures(report: dict) -> dict[tuple[str, int | None, int | None], dict]:
    return {(t["id"], t["gpu"], t["peer"]): t for t in report["tests"]}


def main() -> None:
    quick, full = (json.load(open(p)) for p in sys.argv[1:3])
    ref: dict[int, list[dict]] = {}  # GPU -> the reference runs (before and after zerod diag)
    for line in open(sys.argv[3]):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            ref.setdefault(r["gpu"], []).append(r)
    q, f = figures(quick), figures(full)
    print(f"zerod diag quick: {quick['host'].get('duration_s')} s, exit {quick['summary']['exit_code']}; "
          f"full: {full['host'].get('duration_s')} s, exit {full['summary']['exit_code']}")
    print(f"{'test':<22} {'gpu':<6} {'quick':>22} {'full':>22} {'expected':>14} {'torch alone (before / after)':>30}")
    ref_key = {"diag.hbm_bandwidth": "copy_gb_s", "diag.gemm_bf16": "bf16_matmul_tflops"}
    for key in sorted(set(q) | set(f), key=lambda k: (k[0], k[1] if k[1] is not None else -1,
                                                       k[2] if k[2] is not None else -1)):
        tq, tf = q.get(key), f.get(key)

        def cell(t):
            if t is None:
                return "-"
            m = t.get("measured")
            return f"{t['status']} {m['value']:.1f} {m['unit']}" if m else t["status"]

        t = tq or tf
        exp = t.get("expected")
        alone = " / ".join(str(r[ref_key[key[0]]]) for r in ref.get(key[1], [])) if key[0] in ref_key else ""
        where = "" if key[1] is None else str(key[1]) + (f">{key[2]}" if key[2] is not None else "")
        print(f"{key[0]:<22} {where:<6} {cell(tq):>22} {cell(tf):>22} "
              f"{(str(exp['value']) + ' ' + exp['unit']) if exp else '-':>14} {alone:>30}")


if __name__ == "__main__":
    main()
