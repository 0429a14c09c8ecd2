#!/usr/bin/env python3
"""Markdown tables from a kernels_bench.py result (bench.json), for docs/perf.md.

    python gpu/kernels_table.py $OUT/bench.json     (what `bash gpu/kernels.sh triton` wrote)
Per (kernel, shape): the default variant (what the engine runs), the best variant
timed, achieved GB/s or TFLOP/s, the torch reference and the ratio.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    res = json.load(open(path))
    info = res["info"]
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, commit {info['commit']}, "
          f"{info['date']}; copy {info['copy_GBps']:.0f} GB/s, bf16 matmul {info['matmul_TFLOPs']:.0f} TFLOP/s\n")
    print("| kernel | shape | default: us | GB/s (% copy) or TFLOP/s | best variant: us | torch ref: us | ref / default |")
    print("|---|---|---|---|---|---|---|")
    groups: dict = {}
    for r in res["rows"]:
        groups.setdefault((r["kernel"], r["shape"]), []).append(r)
    for (k, shape), rows in groups.items():
        d = rows[0]
        own = [r for r in rows if "SDPA" not in r["variant"]]
        best = min(own, key=lambda r: r["us"])
        rate = (f"{d['GBps']:.0f} ({d['pct_copy_bw']:.0f}%)" if "GBps" in d
                else (f"{d['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in d else ""))
        ref = f"{d['ref_us']:.1f} ({d.get('ref_timing', '')})" if "ref_us" in d else ""
        ratio = f"{d['speedup']:.1f}x" if "speedup" in d else ""
        bv = f"{best['us']:.2f} ({best['variant']})" if best is not d else "="
        print(f"| {k} | {shape} | {d['us']:.2f} ({d['variant']}, {d.get('timing', 'eager')}) | {rate} | {bv} | {ref} | {ratio} |")
        for s in (r for r in rows if "SDPA" in r["variant"]):
            rate = (f"{s['GBps']:.0f} ({s['pct_copy_bw']:.0f}%)" if "GBps" in s else f"{s.get('TFLOPs', 0):.0f} TFLOP/s")
            print(f"| (torch) | {shape} | {s['us']:.2f} ({s['variant']}) | {rate} | | | |")


if __name__ == "__main__":
    main(sys.argv[1])
