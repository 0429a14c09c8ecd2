"""The LoRA decode kernels' cost per projection against the base product (8B shapes, rank
16, bf16), timed in CUDA graphs the way a decode step replays them (< 1 min on an H200).

For M in (1, 2, 4, 16) rows (a decode step, engine/kernels/lora.py's FUSED_MAX_ROWS and
below) spread over 1 or 8 adapters (slabs for 8, as --max-loras 8): the base F.linear
and every decode way of engine/kernels/lora.py (DECODE: splitk-atomic, two-launch),
each checked against the torch reference first. Then per decode step of 32
layers: the four projections' base products vs their LoRA deltas plus one group_rows,
and a table of the fastest way at each M. Then batch-1 and 2 (over 8 adapters):
splitk-atomic with its column tile and K splits swept; last, big decode steps (M = 64,
200 over 8 adapters: the 200-stream benchmark's steps): two-launch with its expand's
column tile and its shrink's K splits swept; each per step as above. Last, per decode step
through the engine's Linear + LoraProjection: the delta with its own shrink after each
product vs the shrink carried in the product (PROJECTION_ONLY=1: that table alone).

    python3 gpu/lora_kernels_bench.py [OUT.json]     (SMOKE=1: tiny shapes, interpreter)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # zerod from the checkout
sys.path.insert(0, str(ROOT / "gpu"))
from graph_timing import capture_calls  # noqa: E402
SMOKE = os.environ.get("SMOKE", "0") == "1"
if SMOKE:   # the kernels through Triton's CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    from kernel_checks import patch_triton_interpreter

    patch_triton_interpreter()
H, Q, KV, I, LAYERS = (64, 64, 32, 96, 2) if SMOKE else (4096, 4096, 1024, 14336, 32)
PROJ = {"qkv": ((Q, KV, KV), H), "o": ((H,), Q), "gate_up": ((I, I), H), "down": ((H,), I)}
MS = (1, 2, 4, 16)
BIG_MS = (64, 200)
EXPAND_BN = (64, 128, 256)
SHRINK_SPLITS = (None, 1, 4, 16)   # None: lora_shrink's own choice
SPLITK_BN = (128, 256, 512)
SPLITK_SPLITS = (None, 2, 4, 8)      # None: splitk_splits's choice
RANK, SLOTS = 16, 9


def graph_us(fn, calls: int = 16, reps: int = 10) -> float:
    """Microseconds per fn() call: `calls` of them captured in one CUDA graph, replayed."""
    if SMOKE:
        fn()
        return float("nan")
    g = capture_calls(torch, fn, calls)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / (reps * calls)


TOL = 3e-2   # relative to the reference's largest value (bf16 rounding of y)


class Problem:
    """One projection's LoRA problem: x [M, K], its base weight, the adapters' A and B, and
    the torch reference's result for rows of slots idx."""

    def __init__(self, segs: tuple[int, ...], K: int, idx: torch.Tensor, g, dev, dt) -> None:
        from zerod.engine.lora.delta import lora_reference

        M, N = idx.shape[0], sum(segs)
        self.segs = segs
        self.x = torch.randn(M, K, device=dev, generator=g).to(dt)
        self.W = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(dt)
        self.A = (torch.randn(SLOTS, len(segs) * RANK, K, device=dev, generator=g) * 0.02).to(dt)
        self.B = (torch.randn(SLOTS, N, RANK, device=dev, generator=g) * 0.02).to(dt)
        self.y = self.base()
        self.want = lora_reference(self.y.clone(), self.x, self.A, self.B, segs, idx).float()

    def base(self) -> torch.Tensor:
        return F.linear(self.x, self.W)

    def error(self, add) -> float:
        """add(y) adds the delta into y (y reset to the base product first): its error."""
        self.y.copy_(self.base())
        add(self.y)
        return (self.y.float() - self.want).abs().max().item() / (1 + self.want.abs().max().item())


def measure(lora, ways, dev, dt) -> tuple[list[dict], list[str]]:
    """One row per (adapters, M, projection): base_us and <way>_us; and the errors."""
    g = torch.Generator(device=dev).manual_seed(0)
    rows, bad = [], []
    for adapters in (1, 8):
        for M in MS:
            idx = (torch.arange(M, device=dev) % adapters + 1).int()   # every row has an adapter
            groups = lora.group_rows(idx, SLOTS)
            group_us = graph_us(lambda: lora.group_rows(idx, SLOTS))
            for name, (segs, K) in PROJ.items():
                p = Problem(segs, K, idx, g, dev, dt)
                r = dict(proj=name, M=M, adapters=adapters, group_us=group_us, base_us=graph_us(p.base))
                for way in ways:
                    def add(y, fn=lora.DECODE[way]):
                        fn(y, p.x, p.A, p.B, p.segs, groups)
                    if (err := p.error(add)) > TOL:
                        bad.append(f"{way} {name} M={M} adapters={adapters}: error {err:.3g}")
                    r[f"{way}_us"] = graph_us(lambda: add(p.y))
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows, bad


def step_table(rows: list[dict], ways) -> list[dict]:
    """Per (adapters, M): a decode step's base products and each way's extra (4 deltas a
    layer + one group_rows), and the fastest way."""
    steps = []
    for adapters in (1, 8):
        for M in MS:
            sel = [r for r in rows if r["M"] == M and r["adapters"] == adapters]
            base = LAYERS * sum(r["base_us"] for r in sel)
            extra = {w: LAYERS * sum(r[f"{w}_us"] for r in sel) + sel[0]["group_us"] for w in ways}
            fastest = min(ways, key=lambda w: extra[w]) if not SMOKE else "-"
            steps.append(dict(M=M, adapters=adapters, base_us=base, extra_us=extra, fastest=fastest))
    return steps


def sweep_splitk(lora, dev, dt) -> tuple[list[dict], list[str]]:
    """Per small M over 8 adapters: a step's extra for splitk-atomic at each (column tile,
    K splits), checked against the reference."""
    g = torch.Generator(device=dev).manual_seed(2)
    out, bad = [], []
    for M in ((1,) if SMOKE else (1, 2)):
        idx = (torch.arange(M, device=dev) % 8 + 1).int()
        groups = lora.group_rows(idx, SLOTS)
        extra: dict = {}
        for name, (segs, K) in PROJ.items():
            p = Problem(segs, K, idx, g, dev, dt)
            for bn in SPLITK_BN:
                for sp in SPLITK_SPLITS:
                    def add(y, sp=sp, bn=bn):
                        lora.lora_splitk(y, p.x, p.A, p.B, p.segs, groups, sp, bn)
                    if (err := p.error(add)) > TOL:
                        bad.append(f"splitk bn={bn} splits={sp} {name} M={M}: error {err:.3g}")
                    extra.setdefault((bn, sp), {})[name] = LAYERS * graph_us(lambda: add(p.y))
        for (bn, sp), per in extra.items():
            out.append(dict(M=M, bn=bn, splits=sp or "auto", extra_us=sum(per.values()),
                            per_proj_us={k: v / LAYERS for k, v in per.items()}))
    return out, bad


def sweep_big(lora, dev, dt) -> tuple[list[dict], list[str]]:
    """Per big M over 8 adapters: a step's base products and two-launch's extra for each
    (expand column tile, shrink splits), checked against the reference."""
    g = torch.Generator(device=dev).manual_seed(1)
    out, bad = [], []
    for M in ((16,) if SMOKE else BIG_MS):
        idx = (torch.arange(M, device=dev) % 8 + 1).int()
        groups = lora.group_rows(idx, SLOTS)
        base, extra = 0.0, {}
        for name, (segs, K) in PROJ.items():
            p = Problem(segs, K, idx, g, dev, dt)
            base += LAYERS * graph_us(p.base)
            for bn in EXPAND_BN:
                for sp in SHRINK_SPLITS:
                    def add(y, sp=sp, bn=bn):
                        lora.lora_expand(y, lora.lora_shrink(p.x, p.A, groups, sp), p.B, p.segs, groups, bn)
                    if (err := p.error(add)) > TOL:
                        bad.append(f"two-launch bn={bn} splits={sp} {name} M={M}: error {err:.3g}")
                    extra[(bn, sp)] = extra.get((bn, sp), 0.0) + LAYERS * graph_us(lambda: add(p.y))
        group = graph_us(lambda: lora.group_rows(idx, SLOTS))
        for (bn, sp), us in extra.items():
            out.append(dict(M=M, base_us=base, bn=bn, splits=sp or "auto", extra_us=us + group))
    return out, bad


def step_projection(lora, dev, dt) -> tuple[list[dict], list[str]]:
    """Per M over 8 adapters: a decode step's four projections a layer through the engine's
    own Linear + LoraProjection (what a forward runs): base alone, the delta with its own
    shrink after each product (a quantized projection's way), and the shrink carried in the
    product (A in the tail rows of the weight, a plain projection's way). One group_rows a
    step is added to both."""
    from zerod.engine.model.linear import Linear
    from zerod.engine.lora.slabs import LoraBatch, LoraProjection

    g = torch.Generator(device=dev).manual_seed(3)
    batch = LoraBatch(SLOTS)
    own, carried = {}, {}
    for name, (segs, K) in PROJ.items():
        w = (torch.randn(sum(segs), K, device=dev, generator=g) * 0.02).to(dt)
        A = (torch.randn(SLOTS, len(segs) * RANK, K, device=dev, generator=g) * 0.02).to(dt)
        B = (torch.randn(SLOTS, sum(segs), RANK, device=dev, generator=g) * 0.02).to(dt)
        A[0].zero_()
        B[0].zero_()
        for layer, in_weight in ((own, False), (carried, True)):
            lin = Linear(sum(segs), K, bias=False, dtype=dt, device=dev)
            lin.weight.copy_(w)
            lin.lora = LoraProjection(segs, K, RANK, batch, dt, torch.device(dev), lin if in_weight else None)
            assert (lin.lora.weight is not None) == in_weight
            lin.lora.A.copy_(A)
            lin.lora.B.copy_(B)
            layer[name] = lin
    out, bad = [], []
    for M in ((1, 16) if SMOKE else (1, 2, 4, 16, 64, 200)):
        idx = (torch.arange(M, device=dev) % 8 + 1).int()
        xs = {name: torch.randn(M, K, device=dev, generator=g).to(dt) for name, (_, K) in PROJ.items()}
        r = dict(M=M)
        got = {}
        for way, layer in (("base", own), ("own_shrink", own), ("carried", carried)):
            def run():
                return [lin(xs[name]) for name, lin in layer.items()]
            if way == "base":
                batch.clear()
            else:
                batch.set(idx, grouped=not SMOKE)
            got[way] = [y.float() for y in run()]
            r[f"{way}_us"] = LAYERS * graph_us(run)
        batch.clear()
        r["group_us"] = graph_us(lambda: lora.group_rows(idx, SLOTS))
        for a, b in zip(got["own_shrink"], got["carried"]):
            if (err := (a - b).abs().max().item() / (1 + a.abs().max().item())) > TOL:
                bad.append(f"carried shrink M={M}: error {err:.3g} against its own shrink")
        out.append(r)
        print(json.dumps(r), flush=True)
    return out, bad


def print_projection(rows: list[dict]) -> None:
    print("\nper decode step over 8 adapters through Linear + LoraProjection (32 layers x 4 products"
          " + one group_rows): base, the delta with its own shrink, the shrink carried in the product")
    print("   M    base us   own shrink +us (share)   carried +us (share)")
    for o in rows:
        b = o["base_us"]
        print(f"{o['M']:4d} {b:10.1f} " + "".join(
            f"{o[w + '_us'] + o['group_us'] - b:15.1f} ({b / (o[w + '_us'] + o['group_us']):6.1%})"
            for w in ("own_shrink", "carried")))


def main() -> None:
    from zerod.engine.kernels import lora

    dev, dt = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
    if SMOKE:   # tiny K: split it all the same, so the smoke run takes splitk-atomic's split path
        lora.MIN_CHUNK = 32
    ways = list(lora.DECODE)
    if os.environ.get("PROJECTION_ONLY") == "1":   # the last table alone (~10 s)
        proj, bad = step_projection(lora, dev, dt)
        print_projection(proj)
        print("\n" + ("\n".join(bad) if bad else "the carried shrink's sums match the own shrink's"))
        if len(sys.argv) > 1:
            Path(sys.argv[1]).write_text(json.dumps({"projection": proj, "errors": bad}, indent=1))
        sys.exit(1 if bad else 0)
    rows, bad = measure(lora, ways, dev, dt)
    heads = "".join(f"{w + ' us':>18s}" for w in ways)
    print(f"\nproj      M  adapters   base us{heads}   fastest")
    for r in rows:
        us = {w: r[f"{w}_us"] for w in ways}
        best = "-" if SMOKE else min(ways, key=us.get)
        print(f"{r['proj']:8s} {r['M']:2d} {r['adapters']:9d} {r['base_us']:9.1f}"
              + "".join(f"{us[w]:18.1f}" for w in ways) + f"   {best}")
    steps = step_table(rows, ways)
    print(f"\nper decode step ({LAYERS} layers: 4 products + their deltas, one group_rows; "
          f"linear layers only), base vs with the delta (add_lora: splitk-atomic up to "
          f"{lora.SPLITK_MAX_ROWS} rows, two-launch above)")
    print(" M  adapters    base us" + "".join(f"{w + ' +us (share)':>28s}" for w in ways) + "   fastest")
    for s in steps:
        cells = "".join(f"{s['extra_us'][w]:14.1f} ({s['base_us'] / (s['base_us'] + s['extra_us'][w]):6.1%})     "
                        for w in ways)
        print(f"{s['M']:2d} {s['adapters']:9d} {s['base_us']:10.1f}" + cells + f"   {s['fastest']}")
    small, bad_small = sweep_splitk(lora, dev, dt)
    bad += bad_small
    print("\nbatch-1 and 2 over 8 adapters, splitk-atomic swept: column tile x K splits (per step, "
          "without group_rows; per projection us)")
    for b in sorted(small, key=lambda b: (b["M"], b["extra_us"])):
        per = " ".join(f"{k} {v:5.1f}" for k, v in b["per_proj_us"].items())
        print(f"{b['M']:4d} {b['bn']:4d} {b['splits']!s:>5} {b['extra_us']:9.1f}   {per}")
    big, bad_big = sweep_big(lora, dev, dt)
    bad += bad_big
    print("\nbig decode steps over 8 adapters, two-launch swept: expand column tile x shrink K splits")
    print("   M    base us   bn  splits   +us (share)")
    for b in sorted(big, key=lambda b: (b["M"], b["extra_us"])):
        print(f"{b['M']:4d} {b['base_us']:10.1f} {b['bn']:4d} {b['splits']!s:>7} "
              f"{b['extra_us']:9.1f} ({b['base_us'] / (b['base_us'] + b['extra_us']):6.1%})")
    proj, bad_proj = step_projection(lora, dev, dt)
    bad += bad_proj
    print_projection(proj)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "steps": steps, "splitk": small, "big": big,
                                                 "projection": proj,
                                                 "errors": bad,
                                                 "splitk_max_rows": lora.SPLITK_MAX_ROWS}, indent=1))
    print("\n" + ("\n".join(bad) if bad else "every decode way matches the torch reference"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
