#!/usr/bin/env python3
"""Where a decode step's device time goes: the engine in-process on the 8B shape (dummy
weights), one stream (batch-1) and then 200 streams decoding steadily, each window recorded
with torch.profiler (CUPTI: kernels inside CUDA graph replays too). Per window: kernels
grouped by name, their device time per step, and the device's busy share of the wall time
(near 100 %: device-bound; well below: the host or the gaps between kernels hold it up).

    python3 gpu/decode_profile.py MODEL_DIR [--quantization fp8] [--max-model-len N] [OUT.json]

Flags are EngineConfig's (vLLM's names). Prints one table per window; JSON with the rows.
"""

from __future__ import annotations

import argparse
import collections
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
    ap.add_argument("--device", default="auto")   # cpu: a smoke run (no kernels recorded)
    ap.add_argument("--unfused-act-quant", action="store_true",
                    help="FP8: quantize activations in launches of their own (FUSED_ACT_QUANT off)")
    a = ap.parse_args()
    if a.unfused_act_quant:
        from zerod.engine.quant import linear
        linear.FUSED_ACT_QUANT = False

    from zerod.engine.config import EngineConfig
    from zerod.engine.engine import Engine
    from zerod.engine.request import SamplingParams

    eng = Engine(EngineConfig(model=a.model, load_format="dummy", quantization=a.quantization,
                              kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
                              max_num_seqs=a.max_num_seqs, gpu_memory_utilization=0.9, device=a.device,
                              dtype="float32" if a.device == "cpu" else "bfloat16",
                              kv_cache_memory_bytes=64 << 20 if a.device == "cpu" else None))
    eng.start()
    tokens = collections.Counter()
    lock = threading.Lock()

    def on_out(o) -> None:
        with lock:
            tokens["n"] += len(o.token_ids)

    def window(name: str, streams: int) -> dict:
        params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        ids = [eng.submit([(7 * i + j) % 1000 + 10 for j in range(24)], params, on_out) for i in range(streams)]
        time.sleep(2.0 + streams / 100)   # the prompts prefilled, every stream decoding
        acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available()
                else torch.profiler.ProfilerActivity.CPU]   # CUDA alone: no host ops slowed
        with torch.profiler.profile(activities=acts) as prof:
            steps0, n0, t0 = eng._steps, tokens["n"], time.perf_counter()
            time.sleep(a.window_s)
            steps, wall, n = eng._steps - steps0, time.perf_counter() - t0, tokens["n"] - n0
        for rid in ids:
            eng.abort(rid)
        time.sleep(0.5)
        kernels = collections.defaultdict(lambda: [0.0, 0])
        busy = 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels[e.name[:90]]
                us = e.device_time if hasattr(e, "device_time") else e.cuda_time
                k[0] += us
                k[1] += 1
                busy += us
        rows = sorted(([nm, us / max(steps, 1), c / max(steps, 1)] for nm, (us, c) in kernels.items()),
                      key=lambda r: -r[1])
        out = {"window": name, "streams": streams, "steps": steps, "wall_s": wall, "tokens": n,
               "wall_ms_per_step": wall * 1e3 / max(steps, 1), "busy_ms_per_step": busy / 1e3 / max(steps, 1),
               "kernels": rows}
        print(f"\n== {name}: {streams} streams, {steps} steps in {wall:.2f} s "
              f"({out['wall_ms_per_step']:.3f} ms a step wall, {out['busy_ms_per_step']:.3f} ms of kernels, "
              f"{100 * out['busy_ms_per_step'] / max(out['wall_ms_per_step'], 1e-9):.0f} % busy; "
              f"{n / wall:.0f} tokens/s)", flush=True)
        print(f"{'us/step':>9} {'calls/step':>10}  kernel")
        for nm, us, c in rows[:28]:
            print(f"{us:9.1f} {c:10.1f}  {nm}")
        return out

    res = {"config": vars(a), "windows": [window("batch-1", 1), window("200 streams", 200)]}
    Path(a.out).write_text(json.dumps(res, indent=1))
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
