"""Short table of a `zerod bench` JSON against the targets of docs/perf.md ("Targets"),
read from that table so the targets have one owner.

    python3 gpu/server_summary.py bench.json [ready_seconds] [serve_exit_code]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parent.parent / "docs" / "perf.md"
NUMBER = r"([\d.,]+)"


def targets(text: str) -> dict[str, str]:
    """{scenario: target cell} of the table under "## Targets"."""
    table = text[text.index("\n## Targets\n"):].split("\n## ")[1]
    cells = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ")]
    return {k.strip(): v.strip() for k, v in cells}


def target(cells: dict[str, str], scenario: str, pattern: str) -> float | None:
    """The number PATTERN (N marks it) finds in the target of the first scenario that
    starts with SCENARIO; None when the table has no such target."""
    cell = next((v for k, v in cells.items() if k.startswith(scenario)), "")
    m = re.search(re.escape(pattern).replace("N", NUMBER), cell)
    return float(m.group(1).rstrip(".").replace(",", "")) if m else None


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
    t = targets(PERF.read_text())
    figures = [
        ("TTFT 'Hello' p50 ms", g(s, "hello-ttft", "ttft_ms", "p50"), "<=", target(t, 'TTFT "Hello"', "p50 ≤ N")),
        ("TTFT 'Hello' p99 ms", g(s, "hello-ttft", "ttft_ms", "p99"), "", None),
        ("batch-1 decode tok/s", g(s, "decode-b1", "decode_tokens_per_s", "mean"), ">=",
         target(t, "batch-1 decode, bf16", "≥ N")),
        ("200 streams out tok/s", g(s, "streams-200", "output_throughput"), ">=",
         target(t, "200 concurrent streams", "bf16 ≥ N")),
        ("200 streams TTFT p99 ms", g(s, "streams-200", "ttft_ms", "p99"), "<=",
         target(t, "200 concurrent streams", "TTFT p99 ≤ N")),
        ("200 streams engine cores", g(s, "streams-200", "engine_cpu", "cores"), "<=",
         target(t, "engine CPU at 200 streams", "≤ N cores")),
        ("16K prefill TTFT p50 ms", g(s, "prefill-16k", "ttft_ms", "p50"), "<=",
         target(t, "16K-token prompt", "bf16 ≤ N")),
        ("ITL p99/p50 @16K", g(s, "long-context", "itl_p99_over_p50", "long"), "<=",
         target(t, "ITL p99 / p50 while decoding at 16K", "≤ N")),
        ("ITL p99/p50 @1K", g(s, "long-context", "itl_p99_over_p50", "short"), "", None),
        ("ready to serve s", ready, "<=", target(t, "ready to serve", "≤ N s")),
    ]
    print(f"{'figure':28} {'measured':>12} {'target':>10}  ok")
    for name, v, op, tgt in figures:
        if v is None:
            ok, vs = "-", "-"
        else:
            vs = f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
            ok = "" if tgt is None else ("yes" if (v <= tgt if op == "<=" else v >= tgt) else "NO")
        ts = "" if tgt is None else f"{op}{tgt:g}"
        print(f"{name:28} {vs:>12} {ts:>10}  {ok}")
    threads = g(s, "streams-200", "engine_cpu", "threads_cores") or {}
    if threads:
        print("engine threads at 200 streams (cores): "
              + ", ".join(f"{k} {v:.3f}" for k, v in threads.items()))
    failed = sum((v or {}).get("failed", 0) for v in s.values())
    print(f"failed requests: {failed}; serve exit code after SIGTERM: {rc}")


if __name__ == "__main__":
    main()
