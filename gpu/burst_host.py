"""200 streams arriving at once, through the real HTTP server, engine and output poller on
the CPU, with the device modelled: `python3 gpu/burst_host.py`.

It stands with the device tools because it replaces the model. The forward becomes the
host side of a launch, GRAPH_CALLS small torch calls (EAGER_CALLS for a prefill of more
chunks than a prefill graph holds), each giving up the GIL as a CUDA launch does. Then
the device's time passes as a sleep, with the GIL free: the H200's fitted step costs,
3.5 ms + 22 us a prompt token for a prefill and 4.8 ms + 15 us a row for a decode
(docs/perf.md "Step stalls"). The client is `zerod bench --scenario streams-200` (24
prompt, OUTPUT_LEN output tokens) in its own process. Each round runs a fresh engine per
GIL switch interval (Tuning.gil_switch_interval_us), two waves each; medians last.
`--modes in-process,engine-process` compares the engine in the server's process with the
engine in its own (`zerod serve --engine-process`), the device modelled the same way there.

Each wave's steps with prompt chunks are also read back from the engine's step trace
(ZEROD_STEP_TRACE): a launch's time beyond the device time modelled for its rows, which
is the step thread's own work and its waits (for the GIL, for a core). The H200's waves
showed those launches 10x longer while the requests arrive than after (docs/perf.md
"The GIL and the step thread"): the figure a change to the serving path should bring
down, here first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # zerod from the checkout

from zerod.engine.runner.graphs import prefill_graph_for  # noqa: E402

GRAPH_CALLS = 30      # a graph step's host calls: input copies, the replay, sampling
EAGER_CALLS = 600     # an eager prefill forward's launches
OUTPUT_LEN = 32


class ModelledDevice:
    """The runner's model: the launch's host calls, then the device's time, asleep."""

    def __init__(self, runner, vocab: int):
        model = runner.model
        self.graph_slots = runner.pgraph_seqs   # a prefill runs from a graph where one holds it
        self.ops, self.dtype, self.cos_sin = model.ops, model.dtype, model.cos_sin
        self._hidden = torch.zeros(16384, 8)
        self._logits = torch.randn(1024, vocab)
        self._x = torch.zeros(4096)
        self.host_s: list[float] = []   # each forward's host calls, timed

    def __call__(self, tokens, positions, kv, meta, layers=None):
        rows = tokens.shape[0]
        if meta.cu_seqlens_q is not None:
            seqs = meta.cu_seqlens_q.numel() - 1
            calls = GRAPH_CALLS if prefill_graph_for(self.graph_slots, rows, seqs) else EAGER_CALLS
            device_s = 3.5e-3 + 22e-6 * rows
        else:
            calls, device_s = GRAPH_CALLS, 4.8e-3 + 15e-6 * rows
        t = time.perf_counter()
        for _ in range(calls):
            self._x.add_(1)
        self.host_s.append(time.perf_counter() - t)
        time.sleep(device_s)
        return self._hidden[:rows]

    def logits(self, hidden):
        return self._logits[:hidden.shape[0]]


def modelled_s(rows: list[int]) -> float:
    """The device time ModelledDevice sleeps for a step's forwards (prefill rows, decode rows)."""
    prefill, decode = rows
    return (3.5e-3 + 22e-6 * prefill if prefill else 0.0) + (4.8e-3 + 15e-6 * decode if decode else 0.0)


def prompt_extra_ms(trace: Path, t0: float, t1: float) -> list[float]:
    """A launch's time beyond its modelled device time (ms), for the steps with prompt chunks
    launched between t0 and t1 (time.monotonic(), as the trace's "at"). The trace is read once the
    engine is down: the poller writes it buffered."""
    steps = [json.loads(ln) for ln in trace.read_text().splitlines()[1:]]
    return [s["launch_ms"] - 1e3 * modelled_s(s["rows"]) for s in steps
            if t0 <= s["at"] <= t1 and s["chunks"] and sum(s["rows"])]


def modelled_child(fd: str) -> int:
    """The engine's process of --engine-process (engine/process/child.py) with the device
    modelled: the runner's model is replaced as the engine starts."""
    from zerod.engine.core import engine as core
    from zerod.engine.process.child import main as child_main

    start = core.Engine.start

    def modelled_start(self) -> None:
        self.runner.model = ModelledDevice(self.runner, self.vocab_size)
        start(self)

    torch.set_num_threads(1)
    core.Engine.start = modelled_start
    return child_main(["child", fd])


def wave_ttfts(interval_us: int, waves: int, mode: str = "in-process") -> list[dict]:
    os.environ["ZEROD_TUNING"] = json.dumps({"gil_switch_interval_us": interval_us})
    trace = Path(tempfile.mkdtemp(prefix="zerod-burst-")) / "steps.jsonl"
    os.environ["ZEROD_STEP_TRACE"] = str(trace)
    from zerod.engine.api.server import ServerThread
    from zerod.engine.core.engine import Engine, EngineConfig

    cfg = EngineConfig(model="demo", device="cpu", max_model_len=512, kv_pages=4096,
                       max_num_seqs=256, seed=0)
    if mode == "engine-process":
        from zerod.engine.process.client import EngineClient

        eng = EngineClient(cfg, command=[sys.executable, __file__, "--child"])
        dev = None   # the forwards' host calls are timed in the engine's process, not reported
    else:
        eng = Engine(cfg)
        eng.runner.model = dev = ModelledDevice(eng.runner, eng.vocab_size)
        eng.start()
    srv = ServerThread(eng).start()
    out, spans = [], []
    try:
        for _ in range(waves):
            t0 = time.monotonic()
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "zerod", "bench", "--base-url", srv.url,
                                "--scenario", "streams-200", "--output-len", str(OUTPUT_LEN), "--warmup", "0",
                                "--workers", "1", "--no-progress", "--out", f.name],
                               check=True, capture_output=True, timeout=300)
                s = json.load(open(f.name))["scenarios"]["streams-200"]
            host = sorted(dev.host_s) if dev is not None else [float("nan")]
            if dev is not None:
                dev.host_s.clear()
            spans.append((t0, time.monotonic()))
            out.append({"ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
                        "tokens_per_s": s["output_throughput"],
                        "host_p99_ms": 1e3 * host[int(0.99 * (len(host) - 1))], "host_max_ms": 1e3 * host[-1]})
    finally:
        srv.stop()
        eng.shutdown(0)
    for w, (t0, t1) in zip(out, spans):
        extra = prompt_extra_ms(trace, t0, t1)
        w["extra_p50_ms"] = statistics.median(extra) if extra else float("nan")
        w["extra_max_ms"] = max(extra, default=float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals-us", default="5000,500")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--modes", default="in-process",
                    help="in-process and/or engine-process (comma-separated)")
    ap.add_argument("--child", help=argparse.SUPPRESS)   # the engine's process (modelled_child)
    a = ap.parse_args()
    if a.child is not None:
        sys.exit(modelled_child(a.child))
    torch.set_num_threads(1)
    variants = [(u, m) for m in a.modes.split(",") for u in (int(u) for u in a.intervals_us.split(","))]
    runs: dict[tuple[int, str], list[dict]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for u, m in variants:   # alternated: the machine's drift falls on all
            got = wave_ttfts(u, a.waves, m)
            runs[u, m] += got
            print(f"round {r + 1}, {m}, {u} us: " + "; ".join(
                f"TTFT p50 {w['ttft_p50']:.0f} / p99 {w['ttft_p99']:.0f} ms, {w['tokens_per_s']:.0f} tokens/s, "
                f"host calls p99 {w['host_p99_ms']:.1f} / max {w['host_max_ms']:.1f} ms, "
                f"prompt launches beyond the device p50 {w['extra_p50_ms']:.1f} / max {w['extra_max_ms']:.1f} ms"
                for w in got), flush=True)
    print(f"\n| engine, GIL switch interval | 200-stream waves: TTFT p50 / p99 (median of {a.rounds * a.waves}) "
          f"| output tokens/s | a forward's host calls: p99 / worst "
          f"| prompt launches beyond the device time: p50 / worst |")
    print("|---|---|---|---|---|")
    for u, m in variants:
        w = runs[u, m]
        med = {k: statistics.median(x[k] for x in w) for k in w[0]}
        print(f"| {m}, {u} us | {med['ttft_p50']:.0f} / {med['ttft_p99']:.0f} ms | {med['tokens_per_s']:.0f} "
              f"| {med['host_p99_ms']:.1f} / {max(x['host_max_ms'] for x in w):.1f} ms "
              f"| {med['extra_p50_ms']:.1f} / {max(x['extra_max_ms'] for x in w):.1f} ms |")


if __name__ == "__main__":
    main()
