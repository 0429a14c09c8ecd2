"""The LoRA delta's cost per projection against the base product (8B shapes, rank 16, bf16),
timed in CUDA graphs the way a decode step replays them (< 60 s on an H200).

For M in (1, 16, 200, 2048) rows spread over 1 or 8 adapters (slabs for 8, as
--max-loras 8): the base F.linear, the new kernels (engine/kernels/lora.py: group_rows
once per forward, add_lora per projection) and the kernels before them (the first H200
run's, read from git as OLD_REV: a torch counting sort, shrink + reduction + expand);
each checked against the torch reference first. Last, per decode step of 32 layers: the
four projections' base products vs their LoRA deltas plus one grouping.

    python3 gpu/lora_kernels_bench.py [OUT.json]     (SMOKE=1: tiny shapes, interpreter)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # zerod from the checkout
SMOKE = os.environ.get("SMOKE", "0") == "1"
if SMOKE:   # the kernels through Triton's CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    from kernel_checks import patch_triton_interpreter

    patch_triton_interpreter()
OLD_REV = "ecb037f"   # the merge of multi-LoRA: kernels of the first H200 run
H, Q, KV, I, LAYERS = (64, 64, 32, 96, 2) if SMOKE else (4096, 4096, 1024, 14336, 32)
PROJ = {"qkv": ((Q, KV, KV), H), "o": ((H,), Q), "gate_up": ((I, I), H), "down": ((H,), I)}
MS = (1, 16, 40) if SMOKE else (1, 16, 200, 2048)
RANK, SLOTS = 16, 9


def old_kernels():
    """The previous engine/kernels/lora.py as a module, or None outside a git checkout."""
    try:
        src = subprocess.run(["git", "show", f"{OLD_REV}:engine/kernels/lora.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    f = Path(tempfile.mkdtemp()) / "lora_old.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("lora_old", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def old_grouping(idx: torch.Tensor, S: int):
    """The torch counting sort the old kernels took (order, starts, counts)."""
    idx64 = idx.long()
    onehot = idx64.unsqueeze(1) == torch.arange(S, device=idx.device)
    counts = onehot.sum(0)
    starts = counts.cumsum(0) - counts
    rank = onehot.long().cumsum(0).gather(1, idx64.unsqueeze(1)).squeeze(1) - 1
    order = torch.empty_like(idx64)
    order.scatter_(0, starts.index_select(0, idx64) + rank, torch.arange(idx.shape[0], device=idx.device))
    return order.int(), starts.int(), counts.int()


def graph_us(fn, calls: int = 16, reps: int = 10) -> float:
    """Microseconds per fn() call: `calls` of them captured in one CUDA graph, replayed."""
    if SMOKE:
        fn()
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / (reps * calls)


def main() -> None:
    from zerod.engine.kernels import lora as new
    from zerod.engine.lora.delta import lora_reference

    dev, dt = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
    old = old_kernels()
    if old is None:
        print(f"(no git history here: the old kernels ({OLD_REV}) are not timed)")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, bad = [], []
    for adapters in (1, 8):
        for M in MS:
            idx = (torch.arange(M, device=dev) % adapters + 1).int()   # every row has an adapter
            groups = new.group_rows(idx, SLOTS)
            og = old_grouping(idx, SLOTS)
            grp = {"new": graph_us(lambda: new.group_rows(idx, SLOTS)),
                   "old": graph_us(lambda: old_grouping(idx, SLOTS))}
            for name, (segs, K) in PROJ.items():
                N = sum(segs)
                x = torch.randn(M, K, device=dev, generator=g).to(dt)
                W = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(dt)
                A = (torch.randn(SLOTS, len(segs) * RANK, K, device=dev, generator=g) * 0.02).to(dt)
                B = (torch.randn(SLOTS, N, RANK, device=dev, generator=g) * 0.02).to(dt)
                y = F.linear(x, W)
                want = lora_reference(y.clone(), x, A, B, segs, idx).float()
                ways = {"new": lambda: new.add_lora(y, x, A, B, segs, groups)}
                if old is not None:
                    ways["old"] = lambda: old.lora_expand(y, old.lora_shrink(x, A, *og), B, segs, *og)
                r = dict(proj=name, M=M, adapters=adapters, base_us=graph_us(lambda: F.linear(x, W)))
                for way, fn in ways.items():
                    y.copy_(F.linear(x, W))
                    fn()
                    err = (y.float() - want).abs().max().item() / (1 + want.abs().max().item())
                    if err > 3e-2:
                        bad.append(f"{way} {name} M={M} adapters={adapters}: error {err:.3g}")
                    r[f"{way}_us"] = graph_us(fn)
                    r[f"{way}_group_us"] = grp[way]
                rows.append(r)
                print(json.dumps(r), flush=True)
    print("\nproj     M     adapters  base us   new us   old us   new/base")
    for r in rows:
        print(f"{r['proj']:8s} {r['M']:5d} {r['adapters']:8d} {r['base_us']:8.1f} {r['new_us']:8.1f} "
              f"{r.get('old_us', float('nan')):8.1f} {r['new_us'] / r['base_us']:9.1%}")
    print(f"\nper decode step ({LAYERS} layers, 4 projections + one grouping): base products vs "
          "with the LoRA delta (linear layers only; a step also has attention, norms, ...)")
    for adapters in (1, 8):
        for M in MS:
            sel = [r for r in rows if r["M"] == M and r["adapters"] == adapters]
            base = LAYERS * sum(r["base_us"] for r in sel)
            line = f"  M={M:5d} adapters={adapters}: base {base:9.1f} us"
            for way in ("new", "old"):
                if f"{way}_us" in sel[0]:
                    extra = LAYERS * sum(r[f"{way}_us"] for r in sel) + sel[0][f"{way}_group_us"]
                    line += f" | {way} +{extra:8.1f} us = {base / (base + extra):6.1%}"
            print(line)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "errors": bad}, indent=1))
    print("\n" + ("\n".join(bad) if bad else "all kernels match the torch reference"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
