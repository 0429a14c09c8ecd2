"""Does SDPA pay per new sequence length? (H200, < 1 min)

The engine's fresh prompts go through F.scaled_dot_product_attention one sequence at a
time (engine/model.py `_sdpa_varlen`), so every new prompt length is a new shape. A
backend that builds a plan per shape (cuDNN's attention does) pays that on the step
thread's CPU the first time: the third session's slow launches (100-154 ms of the step
thread's own CPU, steps prefilling new prompts of varied lengths) and each FP8 server's
first 16K prompts (573-933 ms to launch, 16,368 then 16,384 tokens) would fit.

For the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16, causal, GQA)
and lengths the ramp's chunks had: the host wall time of the first and the third call of
each length, per backend (the default's choice, then each one forced), and which backend
the default picks.

    python3 gpu/sdpa_shapes.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HK, D = 32, 8, 128
LENGTHS = (31, 45, 98, 114, 128, 200, 511, 2048, 16368, 16384)
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def call_ms(n: int, backend) -> float:
    q = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HK, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if backend is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    host = (time.perf_counter() - t) * 1000   # the launch on the host, before any sync
    torch.cuda.synchronize()
    return host


def main() -> None:
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
           "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(), "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    print(f"{'backend':10s} {'length':>7s} {'first ms':>9s} {'third ms':>9s}")
    for name, backend in BACKENDS.items():
        try:
            call_ms(7, backend)   # the backend's own first use (libraries, handles), not a shape's
        except RuntimeError:
            pass
        for n in LENGTHS:
            try:
                first = call_ms(n, backend)
                call_ms(n, backend)
                third = call_ms(n, backend)
            except RuntimeError as e:   # a backend that refuses the shape
                print(f"{name:10s} {n:7d}  refused: {str(e).splitlines()[0][:80]}")
                continue
            out["rows"].append(dict(backend=name, length=n, first_ms=first, third_ms=third))
            print(f"{name:10s} {n:7d} {first:9.2f} {third:9.2f}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
