"""The short table of gpu/tp.sh: tensor-parallel figures against docs/perf.md's targets ("Targets").

    python3 gpu/tp_summary.py RESULTS_DIR SMALL_SHAPE BIG_SHAPE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def scen(doc: dict, name: str, *path):
    d = doc.get("scenarios", {}).get(name)
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def main() -> None:
    r, small, big = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    b1 = {tp: scen(load(r / f"{small}-tp{tp}-b1.json"), "decode-b1", "decode_tokens_per_s", "mean")
          for tp in (1, 2)}
    big_b1 = scen(load(r / f"{big}-tp2-b1.json"), "decode-b1", "decode_tokens_per_s", "mean")
    s200 = load(r / f"{big}-tp2-s200.json")
    ratio = b1[2] / b1[1] if b1[1] and b1[2] else None
    ar = load(r / "allreduce.json")
    b1_ar = next((x for x in ar.get("decode", []) if x["batch"] == 1), {})
    rows = [
        (f"{big} TP=2 batch-1 decode tok/s", big_b1, ">=", 48.0),
        (f"{big} TP=2 200 streams out tok/s", scen(s200, "streams-200", "output_throughput"), "", None),
        (f"{big} TP=2 200 streams TTFT p50 ms", scen(s200, "streams-200", "ttft_ms", "p50"), "", None),
        (f"{big} TP=2 200 streams TTFT p99 ms", scen(s200, "streams-200", "ttft_ms", "p99"), "", None),
        (f"{small} TP=1 batch-1 decode tok/s", b1[1], "", None),
        (f"{small} TP=2 batch-1 decode tok/s", b1[2], "", None),
        (f"{small} TP=2 / TP=1 batch-1", ratio, ">=", 1.6),
        ("all-reduce [1, hidden] in a graph us", b1_ar.get("graph_us") or b1_ar.get("eager_us"), "", None),
        ("all-reduce per layer (2x) us", b1_ar.get("per_layer_us"), "", None),
        ("all-reduce 256 MiB bus GB/s", ar.get("bus_GBps"), "", None),
    ]
    print(f"{'figure':40} {'measured':>12} {'target':>8}  ok")
    for name, v, op, tgt in rows:
        vs = "-" if v is None else (f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}")
        ok = "-" if v is None or tgt is None else ("yes" if (v >= tgt if op == ">=" else v <= tgt) else "NO")
        print(f"{name:40} {vs:>12} {'' if tgt is None else op + format(tgt, 'g'):>8}  {ok}")


if __name__ == "__main__":
    main()
