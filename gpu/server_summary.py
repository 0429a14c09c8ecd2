"""Short table of a `zerod bench` JSON against the targets of docs/perf.md (Targets and ceilings).

    python3 gpu/server_summary.py bench.json [ready_seconds] [serve_exit_code]
"""

from __future__ import annotations

import json
import sys


def g(d, *path):
    for p in path:
        if not isinstance(d, dict) or d.get(p) is None:
            return None
        d = d[p]
    return d


def main() -> None:
    doc = json.load(open(sys.argv[1]))
    ready = float(sys.argv[2]) if len(sys.argv) > 2 else None
    rc = sys.argv[3] if len(sys.argv) > 3 else "?"
    s = doc.get("scenarios", {})
    rows = [
        ("TTFT 'Hello' p50 ms", g(s, "hello-ttft", "ttft_ms", "p50"), "<=", 12.0, "41.3"),
        ("TTFT 'Hello' p99 ms", g(s, "hello-ttft", "ttft_ms", "p99"), "<=", 20.0, "45.3 (p95)"),
        ("batch-1 decode tok/s", g(s, "decode-b1", "decode_tokens_per_s", "mean"), ">=", 250.0,
         "15.3"),
        ("200 streams out tok/s", g(s, "streams-200", "output_throughput"), ">=", 20000.0,
         "1931"),
        ("200 streams TTFT p99 ms", g(s, "streams-200", "ttft_ms", "p99"), "<=", 200.0, "-"),
        ("200 streams engine cores", g(s, "streams-200", "engine_cpu", "cores"), "<=", 1.5, "-"),
        ("16K prefill TTFT p50 ms", g(s, "prefill-16k", "ttft_ms", "p50"), "<=", 480.0, "573"),
        ("ITL p99/p50 @16K", g(s, "long-context", "itl_p99_over_p50", "long"), "<=", 1.12, "-"),
        ("ITL p99/p50 @1K", g(s, "long-context", "itl_p99_over_p50", "short"), "", None, "-"),
        ("ready to serve s", ready, "<=", 30.0, "-"),
    ]
    print(f"{'figure':28} {'measured':>12} {'target':>10}  {'HF':>10}  ok")
    for name, v, op, tgt, hf in rows:
        if v is None:
            ok, vs = "-", "-"
        else:
            vs = f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
            ok = "" if tgt is None else ("yes" if (v <= tgt if op == "<=" else v >= tgt) else "NO")
        ts = "" if tgt is None else f"{op}{tgt:g}"
        print(f"{name:28} {vs:>12} {ts:>10}  {hf:>10}  {ok}")
    lc = g(s, "long-context")
    if lc:
        short, long = g(lc, "itl_p99_over_p50", "short"), g(lc, "itl_p99_over_p50", "long")
        if short is not None and long is not None:
            print(f"{'ITL ratio 16K - 1K':28} {long - short:>12.3f} {'<=0.02':>10}  {'-':>10}  "
                  f"{'yes' if long - short <= 0.02 else 'NO'}")
    threads = g(s, "streams-200", "engine_cpu", "threads_cores") or {}
    if threads:
        print("engine threads at 200 streams (cores): "
              + ", ".join(f"{k} {v:.3f}" for k, v in threads.items()))
    failed = sum((v or {}).get("failed", 0) for v in s.values())
    print(f"failed requests: {failed}; serve exit code after SIGTERM: {rc}")


if __name__ == "__main__":
    main()
