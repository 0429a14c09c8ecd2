"""The table of a gpu/round2.sh run: each figure, run A's (docs/perf.md §7) and the target.

    python3 gpu/round2_summary.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_summary import g  # noqa: E402 - the one JSON path getter of the device tables


def load(d: Path, name: str) -> dict:
    try:
        return json.loads((d / f"{name}.json").read_text()).get("scenarios", {})
    except (OSError, ValueError):
        return {}


def main() -> None:
    d = Path(sys.argv[1])
    a, first, big = load(d, "runA"), load(d, "first-burst"), load(d, "bigtok")
    m25, m10, pre = load(d, "mix25"), load(d, "mix10"), load(d, "prefix")
    oa, of, om = load(d, "old-runA"), load(d, "old-first-burst"), load(d, "old-mix25")
    poller = g(big, "streams-200", "engine_cpu", "threads_cores", "zerod-poller")
    poller_demo = g(a, "streams-200", "engine_cpu", "threads_cores", "zerod-poller")
    rows = [
        # figure, measured, run A (or the code before this round, same call), op, target
        ("TTFT 'Hello' p50 ms", g(a, "hello-ttft", "ttft_ms", "p50"), 6.7, "<=", 5.0),
        ("TTFT 'Hello' p99 ms", g(a, "hello-ttft", "ttft_ms", "p99"), 7.3, "", None),
        ("batch-1 decode tok/s", g(a, "decode-b1", "decode_tokens_per_s", "mean"), 212, ">=", 250),
        ("200 streams out tok/s", g(a, "streams-200", "output_throughput"), 21103, ">=", 24000),
        ("200 streams TTFT p99 ms", g(a, "streams-200", "ttft_ms", "p99"), 166, "<=", 150),
        ("first burst out tok/s", g(first, "streams-200", "output_throughput"), 17857, ">=", 24000),
        ("first burst TTFT p99 ms", g(first, "streams-200", "ttft_ms", "p99"), 380, "<=", 150),
        ("200 streams engine cores", g(a, "streams-200", "engine_cpu", "cores"), 0.75, "<=", 1.5),
        ("16K prefill TTFT p50 ms", g(a, "prefill-16k", "ttft_ms", "p50"), 490, "<=", 450),
        ("ITL p99/p50 @16K", g(a, "long-context", "itl_p99_over_p50", "long"), 1.068, "<=", 1.10),
        ("mix 25/s ITL p99 ms", g(m25, "mix", "itl_ms", "p99"), 152, "<=", 60),
        ("mix 25/s TTFT p99 ms", g(m25, "mix", "ttft_ms", "p99"), 632, "<=", 400),
        ("mix 25/s TTFT p50 ms", g(m25, "mix", "ttft_ms", "p50"), 272, "", None),
        ("mix 25/s goodput share", g(m25, "mix", "goodput", "share"), None, "", None),
        ("mix 10/s ITL p99 ms", g(m10, "mix", "itl_ms", "p99"), 51, "<=", 25),
        ("mix 10/s TTFT p99 ms", g(m10, "mix", "ttft_ms", "p99"), 221, "", None),
        ("prefix TTFT p50 ms", g(pre, "prefix", "ttft_ms", "p50"), 255, "<=", 25),
        ("prefix TTFT p99 ms", g(pre, "prefix", "ttft_ms", "p99"), 820, "<=", 80),
        ("prefix hit rate", g(pre, "prefix", "prefix_cache_hit_rate"), None, "", None),
        ("poller cores, demo tokenizer", poller_demo, 0.13, "", None),
        ("poller cores, 128K tokenizer", poller, None, "<", 0.01),
        ("128K tok: 200 streams tok/s", g(big, "streams-200", "output_throughput"), None, "", None),
    ]
    if oa:   # the same scenarios on the code before this round, in this call: the reference
        for i, (name, v, ref, op, tgt) in enumerate(rows):
            old = {"TTFT 'Hello' p50 ms": g(oa, "hello-ttft", "ttft_ms", "p50"),
                   "TTFT 'Hello' p99 ms": g(oa, "hello-ttft", "ttft_ms", "p99"),
                   "batch-1 decode tok/s": g(oa, "decode-b1", "decode_tokens_per_s", "mean"),
                   "200 streams out tok/s": g(oa, "streams-200", "output_throughput"),
                   "200 streams TTFT p99 ms": g(oa, "streams-200", "ttft_ms", "p99"),
                   "first burst out tok/s": g(of, "streams-200", "output_throughput"),
                   "first burst TTFT p99 ms": g(of, "streams-200", "ttft_ms", "p99"),
                   "200 streams engine cores": g(oa, "streams-200", "engine_cpu", "cores"),
                   "16K prefill TTFT p50 ms": g(oa, "prefill-16k", "ttft_ms", "p50"),
                   "ITL p99/p50 @16K": g(oa, "long-context", "itl_p99_over_p50", "long"),
                   "mix 25/s ITL p99 ms": g(om, "mix", "itl_ms", "p99"),
                   "mix 25/s TTFT p99 ms": g(om, "mix", "ttft_ms", "p99"),
                   "mix 25/s TTFT p50 ms": g(om, "mix", "ttft_ms", "p50"),
                   "mix 25/s goodput share": g(om, "mix", "goodput", "share"),
                   "poller cores, demo tokenizer": g(oa, "streams-200", "engine_cpu", "threads_cores", "zerod-poller"),
                   }.get(name)
            if old is not None:
                rows[i] = (name, v, round(old, 3), op, tgt)
    ref_name = "before" if oa else "run A"
    ff, fs = load(d, "fixed-first-burst"), load(d, "fixed-s200")
    if fs:
        rows += [("fixed budget: s200 tok/s", g(fs, "streams-200", "output_throughput"), None, "", None),
                 ("fixed budget: s200 TTFT p99", g(fs, "streams-200", "ttft_ms", "p99"), None, "", None),
                 ("fixed budget: 1st burst tok/s", g(ff, "streams-200", "output_throughput"), None, "", None),
                 ("fixed budget: 1st TTFT p99", g(ff, "streams-200", "ttft_ms", "p99"), None, "", None)]
    print(f"{'figure':30} {'measured':>10} {ref_name:>8} {'target':>9}  ok")
    for name, v, ref, op, tgt in rows:
        ok = ""
        if v is not None and tgt is not None:
            ok = "yes" if {"<=": v <= tgt, ">=": v >= tgt, "<": v < tgt}[op] else "NO"
        fv = "-" if v is None else f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        fr = "-" if ref is None else f"{ref:,.3f}" if abs(ref) < 10 else f"{ref:,.1f}"
        ft = "-" if tgt is None else f"{op}{tgt:,}"
        print(f"{name:30} {fv:>10} {fr:>8} {ft:>9}  {ok}")


if __name__ == "__main__":
    main()
