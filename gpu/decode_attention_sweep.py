"""Decode attention's tile, warps and stages at the batch sizes of many streams, graph-timed:
`python3 gpu/decode_attention_sweep.py [--out FILE.json]`.

The Llama-3-8B shape (32 query heads over 8 KV heads, head_dim 128, bf16, 16-token pages
scattered over a pool as the engine's allocator leaves them). Each case is a batch with its
contexts: a 200-stream wave's spread (24 to 152 tokens, uniform), all at 88 (that wave's
mean) or all at 152 (its end), and 64 streams at 1K. Each config runs 32 times in one CUDA
graph (`graph_timing.capture_calls`), the median replay's device time a call; its output
must equal the default config's to 2e-2 (different tile orders round differently). The
table prints the default and the best config per case, and each case's bytes-read bound.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # zerod from the checkout

from graph_timing import capture_calls, replay_ms  # noqa: E402
from step_breakdown import HBM, LLAMA3_8B  # noqa: E402
from zerod.engine.config import EngineConfig  # noqa: E402
from zerod.engine.kernels import decode_attention as da  # noqa: E402

HQ, HK, D = LLAMA3_8B.heads, LLAMA3_8B.kv_heads, LLAMA3_8B.head_dim
PAGE = EngineConfig.block_size    # the engine's KV page


def case(batch: int, lens: torch.Tensor, pool_pages: int = 8192, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages = -(-int(lens.max()) // PAGE)
    order = torch.randperm(pool_pages, generator=g)[:batch * pages].view(batch, pages)
    kc = torch.randn(pool_pages, PAGE, HK, D, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(pool_pages, PAGE, HK, D, generator=g).to("cuda", torch.bfloat16)
    q = torch.randn(batch, HQ, D, generator=g).to("cuda", torch.bfloat16)
    return q, kc, vc, order.to("cuda", torch.int32), lens.to("cuda", torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    cases = {
        "B=200 wave (24-152)": (200, torch.randint(24, 153, (200,), generator=g)),
        "B=200 ctx 88": (200, torch.full((200,), 88)),
        "B=200 ctx 152": (200, torch.full((200,), 152)),
        "B=64 ctx 1K": (64, torch.full((64,), 1024)),
    }
    default = (da.DEFAULT_BLOCK_N, da.DEFAULT_NUM_WARPS, da.DEFAULT_NUM_STAGES)
    configs = [default] + [c for c in itertools.product((16, 32, 64), (1, 2, 4), (1, 2, 3, 4)) if c != default]
    rows = []
    for name, (b, lens) in cases.items():
        q, kc, vc, bt, cl = case(b, lens)
        scale = D ** -0.5
        bound_us = float(lens.sum()) * HK * D * 2 * 2 / HBM * 1e6   # K and V, bf16, read once
        ref = da.decode_attention(q, kc, vc, bt, cl, scale)
        for bn, w, st in configs:
            fn = lambda: da.decode_attention(q, kc, vc, bt, cl, scale, block_n=bn, num_warps=w, num_stages=st)  # noqa: E731
            try:
                err = float((fn().float() - ref.float()).abs().max())
                us = replay_ms(torch, capture_calls(torch, fn, 32), 20) * 1e3 / 32
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses (shared memory)
                print(json.dumps({"case": name, "config": [bn, w, st], "error": str(e)[:160]}), flush=True)
                continue
            r = {"case": name, "config": [bn, w, st], "us": round(us, 2), "max_err": err,
                 "bound_us": round(bound_us, 2), "ok": err < 2e-2}
            rows.append(r)
            print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"\ndevice: {torch.cuda.get_device_name()}")
    print("| case | default (BLOCK_N / warps / stages) | best | bytes' bound |")
    print("|---|---|---|---|")
    for name in cases:
        rs = [r for r in rows if r["case"] == name and r["ok"]]
        d = next(r for r in rs if tuple(r["config"]) == default)
        best = min(rs, key=lambda r: r["us"])
        print(f"| {name} | {d['us']:.2f} µs ({'/'.join(map(str, default))}) | {best['us']:.2f} µs "
              f"({'/'.join(map(str, best['config']))}) | {d['bound_us']:.2f} µs |")


if __name__ == "__main__":
    main()
