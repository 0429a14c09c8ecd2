#!/usr/bin/env python3
"""Where a step's device time goes: the engine in-process on the 8B shape (dummy weights),
recorded with torch.profiler (CUPTI: kernels inside CUDA graph replays too) over four
windows: one stream and 200 streams decoding steadily (one second each, every stream
already decoding), 200 requests of 24 prompt / 128 output tokens sent at once (the
200-stream bench scenario, recorded from the first submit to the last token), and one
16K-token prompt to its first token (with --max-model-len above 16K). Per window: kernels
grouped by name with their device time per step, and the device's busy share of the wall
time (near 100 %: device-bound; well below: the host or the gaps between kernels).

    python3 gpu/decode_profile.py MODEL_DIR [--quantization fp8] [--max-model-len N] [OUT.json]

Flags are EngineConfig's (vLLM's names). Prints one table per window; JSON with the rows.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # zerod from the checkout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out", nargs="?", default="/tmp/decode_profile.json")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=17408)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--windows", default="steady,wave,16k", help="which of steady, wave, 16k")
    ap.add_argument("--device", default="auto")   # cpu: a smoke run (no kernels recorded)
    a = ap.parse_args()

    from zerod.engine.config import EngineConfig
    from zerod.engine.core.engine import Engine
    from zerod.engine.core.request import SamplingParams

    eng = Engine(EngineConfig(model=a.model, load_format="dummy", quantization=a.quantization,
                              kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
                              max_num_seqs=a.max_num_seqs, gpu_memory_utilization=0.9, device=a.device,
                              dtype="float32" if a.device == "cpu" else "bfloat16",
                              kv_cache_memory_bytes=64 << 20 if a.device == "cpu" else None))
    eng.start()
    tokens = collections.Counter()
    lock = threading.Lock()

    done = threading.Event()
    waiting = collections.Counter()

    def on_out(o) -> None:
        with lock:
            tokens["n"] += len(o.token_ids)
            if o.finished:
                waiting["n"] -= 1
                if waiting["n"] == 0:
                    done.set()

    runs = itertools.count()

    def prompt(i: int, n: int, run: int = 0) -> list[int]:
        """Prompt i of a run: distinct from every other run's (no prefix-cache hits)."""
        return [(7 * i + j + 389 * run) % 1000 + 10 for j in range(n)]

    def profiled(run) -> tuple:
        """run() inside a CUDA-only profile (no host ops slowed): (kernels {name: [us, calls]},
        steps, wall s, tokens) of that span."""
        acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
                else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            steps0, n0, t0 = eng._steps, tokens["n"], time.perf_counter()
            run()
            steps, wall, n = eng._steps - steps0, time.perf_counter() - t0, tokens["n"] - n0
        kernels = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels[e.name[:90]]
                k[0] += e.device_time if hasattr(e, "device_time") else e.cuda_time
                k[1] += 1
        return kernels, steps, wall, n

    def report(name: str, streams: int, kernels: dict, steps: int, wall: float, n: int) -> dict:
        busy = sum(us for us, _ in kernels.values())
        rows = sorted(([nm, us / max(steps, 1), c / max(steps, 1)] for nm, (us, c) in kernels.items()),
                      key=lambda r: -r[1])
        out = {"window": name, "streams": streams, "steps": steps, "wall_s": wall, "tokens": n,
               "wall_ms_per_step": wall * 1e3 / max(steps, 1), "busy_ms_per_step": busy / 1e3 / max(steps, 1),
               "kernels": rows}
        print(f"\n== {name}: {streams} streams, {steps} steps in {wall:.3f} s "
              f"({out['wall_ms_per_step']:.3f} ms a step wall, {out['busy_ms_per_step']:.3f} ms of kernels, "
              f"{100 * out['busy_ms_per_step'] / max(out['wall_ms_per_step'], 1e-9):.0f} % busy; "
              f"{n / wall:.0f} tokens/s)", flush=True)
        print(f"{'us/step':>9} {'calls/step':>10}  kernel")
        for nm, us, c in rows[:28]:
            print(f"{us:9.1f} {c:10.1f}  {nm}")
        return out

    def steady(name: str, streams: int) -> dict:
        """streams decoding long outputs, a window of window_s once every one decodes."""
        params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        ids = [eng.submit(prompt(i, 24), params, on_out) for i in range(streams)]
        time.sleep(2.0 + streams / 100)   # the prompts prefilled, every stream decoding
        res = profiled(lambda: time.sleep(a.window_s))
        for rid in ids:
            eng.abort(rid)
        time.sleep(0.5)
        return report(name, streams, *res)

    def wave(name: str, streams: int, prompt_len: int, max_tokens: int) -> dict:
        """streams sent at once, recorded from the first submit to the last output (as a
        bench scenario's requests): the ramp, the prefills and the tail included."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def run() -> None:
            done.clear()
            waiting["n"] = streams
            r = next(runs) + 1
            for i in range(streams):
                eng.submit(prompt(i, prompt_len, r), params, on_out)
            done.wait(60)

        run()   # once unrecorded: the shapes' first launches (a cuDNN plan for a new length)
        time.sleep(0.3)
        return report(name, streams, *profiled(run))

    windows = []
    if "steady" in a.windows:
        windows += [steady("batch-1", 1), steady("200 streams", 200)]
    if "wave" in a.windows:
        windows.append(wave("200 x (24 in, 128 out) at once", 200, 24, 128))
    if "16k" in a.windows and a.max_model_len > 16384:
        windows.append(wave("one 16K prompt to its first token", 1, 16384, 1))
    # the model's config.json with it: gpu/step_breakdown.py reads the shape from there
    res = {"config": vars(a), "model_config": json.loads((Path(a.model) / "config.json").read_text()),
           "windows": windows}
    Path(a.out).write_text(json.dumps(res, indent=1))
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
