"""Does SDPA pay per new sequence length? (H200, < 1 min)

The engine's fresh prompts go through F.scaled_dot_product_attention one sequence at a
time (engine/model/decoder.py `_sdpa_varlen`), so every new prompt length is a new shape. A
backend that builds a plan per shape (cuDNN's attention does) pays that on the step
thread's CPU the first time, stalling every stream (docs/perf.md "Step stalls").

For the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16, causal, GQA)
and lengths the ramp's chunks had: per backend (the default's choice, then each one
forced) the host milliseconds of the first and the third call at each length, and the
device milliseconds of the third; then the default with engine/model/decoder.py's padded
lengths (`sdpa_length`, what Tuning.sdpa_pad_lengths does). Last, a verdict line.

    python3 gpu/sdpa_shapes.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerod.engine.model.decoder import sdpa_length  # noqa: E402

HQ, HK, D = 32, 8, 128
LENGTHS = (31, 45, 98, 114, 128, 200, 511, 2048, 16368, 16384)
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def call(n: int, backend) -> tuple[float, float]:
    """(host ms of the call, device ms of its kernels)."""
    q = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HK, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    a.record()
    if backend is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    b.record()
    host = (time.perf_counter() - t) * 1000   # the launch on the host, before any sync
    torch.cuda.synchronize()
    return host, a.elapsed_time(b)


def main() -> None:
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
           "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(), "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    print(f"{'backend':14s} {'length':>7s} {'first ms':>9s} {'third ms':>9s} {'device ms':>10s}")
    variants = [(name, backend, False) for name, backend in BACKENDS.items()] + [("default+pad", None, True)]
    for name, backend, pad in variants:
        try:
            call(7, backend)   # the backend's own first use (libraries, handles), not a shape's
        except Exception:   # noqa: BLE001 - a backend that refuses: the loop below says so
            pass
        for n in LENGTHS:
            m = sdpa_length(n) if pad else n
            try:
                first, _ = call(m, backend)
                call(m, backend)
                third, dev = call(m, backend)
            except Exception as e:   # noqa: BLE001 - a backend that refuses the shape
                print(f"{name:14s} {m:7d}  refused: {str(e).splitlines()[0][:80]}")
                continue
            out["rows"].append(dict(variant=name, length=n, run_length=m, first_ms=first,
                                    third_ms=third, device_ms=dev))
            print(f"{name:14s} {m:7d} {first:9.2f} {third:9.2f} {dev:10.3f}", flush=True)
    d = [r for r in out["rows"] if r["variant"] == "default"]
    if d:
        print(f"verdict: the default's first call at a new length takes a median "
              f"{statistics.median(r['first_ms'] for r in d):.1f} ms on the host, its third "
              f"{statistics.median(r['third_ms'] for r in d):.2f} ms")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
