"""Where a big decode step's LoRA delta goes (8B shapes, rank 16, bf16, 8 adapters): per
projection at M = 64 and 200 rows, each piece of the two-launch delta timed alone in a CUDA
graph (engine/kernels/lora.py's shrink and expand; a zeroed buffer and an add, what a
delta beside the product costs; the product widened by the A rows and the expand from its
tail, the shrink carried in the product) beside the base product, and the shrink's K splits, the expand's column
tile and the rows per tile swept. Per decode step = 32 x the sum over the four projections.
Then prefill-sized forwards (T = 512-4800 rows): the shrink with its K splits by the rule
before and by shrink_splits, and the expand. (< 1 min on an H200.)

    python3 gpu/lora_parts_bench.py [OUT.json]     (SMOKE=1: tiny shapes, interpreter;
                                                    PREFILL_ONLY=1: the prefill tables alone)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_kernels_bench import LAYERS, PROJ, SLOTS, SMOKE, Problem, graph_us  # noqa: E402


def carried(p, segs, K, dev, dt):
    """The engine's own LoraProjection over a Linear of p's weight, A in the weight's tail
    rows (lora/slabs.py), and the xa columns of its product: (product fn, xa of a product)."""
    from zerod.engine.model.linear import Linear
    from zerod.engine.lora.slabs import LoraBatch, LoraProjection

    lin = Linear(sum(segs), K, bias=False, dtype=dt, device=dev)
    lin.weight.copy_(p.W)
    proj = LoraProjection(segs, K, p.A.shape[1] // len(segs), LoraBatch(p.A.shape[0]), dt, torch.device(dev), lin)
    proj.A.copy_(p.A)
    w, n = proj.weight, proj.n
    return (lambda: F.linear(p.x, w)), F.linear(p.x, w)[:, n:n + proj.rows]


def main() -> None:
    from zerod.engine.kernels import lora

    dev, dt = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    keep_bm = lora.DECODE_BLOCK_M
    for M in (() if os.environ.get("PREFILL_ONLY") == "1" else (64, 200)):
        idx = (torch.arange(M, device=dev) % 8 + 1).int()
        for bm in (16, 32):
            lora.DECODE_BLOCK_M = bm
            groups = lora.group_rows(idx, SLOTS)
            for name, (segs, K) in PROJ.items():
                p = Problem(segs, K, idx, g, dev, dt)
                N = sum(segs)
                r = dict(M=M, bm=bm, proj=name, base_us=graph_us(p.base))
                r["zeros_us"] = graph_us(lambda: torch.zeros(M, N, dtype=dt, device=dev))
                d = torch.zeros(M, N, dtype=dt, device=dev)
                r["add_us"] = graph_us(lambda: p.y.add_(d))
                for splits in (None, 4, 8, 16):
                    r[f"shrink_s{splits or 'auto'}_us"] = graph_us(lambda: lora.lora_shrink(p.x, p.A, groups, splits))
                part = lora.lora_shrink(p.x, p.A, groups)
                for bn in (None, 128, 256, 512):
                    r[f"expand_bn{bn or 'auto'}_us"] = graph_us(
                        lambda: lora.lora_expand(p.y, part, p.B, segs, groups, bn))
                one = lora.lora_shrink(p.x, p.A, groups, 1)   # the expand reading one partial
                r["expand_1part_us"] = graph_us(lambda: lora.lora_expand(p.y, one, p.B, segs, groups))
                err = p.error(lambda y: lora.lora_two_launch(y, p.x, p.A, p.B, segs, groups))
                # the shrink carried in the product: the wider product, the expand from its tail
                wide, xa = carried(p, segs, K, dev, dt)
                r["wide_base_us"] = graph_us(wide)
                r["expand_slots_us"] = graph_us(lambda: lora.lora_expand_slots(p.y, xa, p.B, segs, groups))
                err = max(err, p.error(lambda y: lora.lora_expand_slots(y, xa, p.B, segs, groups)))
                r["error"] = err
                rows.append(r)
                print(json.dumps(r), flush=True)
    lora.DECODE_BLOCK_M = keep_bm
    keys = [k for k in rows[0] if k.endswith("_us")] if rows else []
    print("\nper decode step (x32 layers, summed over qkv, o, gate_up, down), us")
    print(f"{'M':>4} {'bm':>3} " + " ".join(f"{k[:-3]:>13s}" for k in keys))
    for M in ((64, 200) if rows else ()):
        for bm in (16, 32):
            sel = [r for r in rows if r["M"] == M and r["bm"] == bm]
            print(f"{M:4d} {bm:3d} " + " ".join(f"{LAYERS * sum(r[k] for r in sel):13.1f}" for k in keys))
    # prefill-sized forwards: the shrink's K splits by the rule before (2048 // T, kept here
    # as the baseline) and now (shrink_splits: ~TARGET_PROGRAMS programs), the expand after it
    pre = []
    for T in (512, 1024, 2048, 4800):
        idx = (torch.arange(T, device=dev) % 8 + 1).int()
        groups = lora.group_rows(idx, SLOTS)
        for name, (segs, K) in PROJ.items():
            p = Problem(segs, K, idx, g, dev, dt)
            old = max(1, min(32, K // 256, max(2048 // T, 1)))
            new = lora.shrink_splits(T, K, groups.tiles.shape[1])
            r = dict(T=T, proj=name, splits_before=old, splits_now=new, base_us=graph_us(p.base, calls=4))
            r["shrink_before_us"] = graph_us(lambda: lora.lora_shrink(p.x, p.A, groups, old), calls=4)
            r["shrink_now_us"] = graph_us(lambda: lora.lora_shrink(p.x, p.A, groups, new), calls=4)
            part = lora.lora_shrink(p.x, p.A, groups, new)
            r["expand_us"] = graph_us(lambda: lora.lora_expand(p.y, part, p.B, segs, groups), calls=4)
            for bn in (64, 128, 256):
                for w in (4, 8):
                    r[f"expand_bn{bn}_w{w}_us"] = graph_us(
                        lambda: lora.lora_expand(p.y, part, p.B, segs, groups, bn, w), calls=4)
            wide, xa = carried(p, segs, K, dev, dt)
            r["wide_base_us"] = graph_us(wide, calls=4)
            r["expand_slots_us"] = graph_us(lambda: lora.lora_expand_slots(p.y, xa, p.B, segs, groups), calls=4)
            r["error"] = max(p.error(lambda y: lora.lora_two_launch(y, p.x, p.A, p.B, segs, groups)),
                             p.error(lambda y: lora.lora_expand_slots(y, xa, p.B, segs, groups)))
            pre.append(r)
            print(json.dumps(r), flush=True)
    print("\nper prefill forward over 8 adapters (x32 layers, the four projections), us")
    print(f"{'T':>5} {'base':>9} {'shrink before':>14} {'shrink now':>11} {'expand':>9} {'wide base':>10} {'expand slots':>13}")
    for T in (512, 1024, 2048, 4800):
        sel = [r for r in pre if r["T"] == T]
        print(f"{T:5d} " + " ".join(f"{LAYERS * sum(r[k] for r in sel):{w}.1f}" for k, w in
                                    (("base_us", 9), ("shrink_before_us", 14), ("shrink_now_us", 11), ("expand_us", 9),
                                     ("wide_base_us", 10), ("expand_slots_us", 13))))
    ex = [k for k in pre[0] if k.startswith("expand_bn")]
    print("\nthe expand swept (column tile, warps), per prefill forward, us")
    print(f"{'T':>5} " + " ".join(f"{k[7:-3]:>10s}" for k in ex))
    for T in (512, 1024, 2048, 4800):
        sel = [r for r in pre if r["T"] == T]
        print(f"{T:5d} " + " ".join(f"{LAYERS * sum(r[k] for r in sel):10.1f}" for k in ex))
    rows += pre
    worst = max(r["error"] for r in rows)
    print(f"\nlargest error against the torch reference: {worst:.3g}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
