#!/usr/bin/env python3
"""The FP8 projections at the Llama-3-8B shapes on one GPU: which product is fastest at
which M (the step's tokens), and so Fp8Linear's W8A16_MAX_M (engine/quant/linear.py).

For qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336 and M in
(1, 4, 16, 64, 200, 512, 2048), through the engine's own code:
  bf16       the unquantized projection (engine/linear.py's Linear: F.linear)
  w8a8       per-channel weights: per-token activation quant + torch._scaled_mm (Fp8Linear.w8a8)
  w8a16      per-channel weights: the Triton W8A16 kernel (Fp8Linear.w8a16)
  w8a8-blk   128x128 block weights: per-token-group quant + the Triton block GEMM
  w8a16-blk  128x128 block weights: the W8A16 kernel with block scales
and `quant`, the per-token activation quantization alone (part of w8a8's time): what
fusing it into the RMSNorm before qkv and gate_up would save at most, per projection.
Each FP8 product is checked against the dequantized float32 reference first (nothing is timed if one
fails), then timed inside a CUDA graph that cycles through enough copies of the weights
that none is in L2 when read (a decode step reads each layer's weights cold): median of
replays, per call. GB/s: the bytes a call must move (weights, scales, activations in,
output) over its time. Then a sweep of the W8A16 tiles (BLOCK_N x BLOCK_K) at M=1 and 16.

Last: the per-layer sums (the four projections) and the thresholds they imply, the
largest M of the list up to which W8A16 beats W8A8 at every M. Everything into
$OUT/fp8_gemm.json. ~1 min on an H200. SMOKE=1: tiny shapes on the CPU through Triton's
interpreter (wall-clock, no graphs), to prove the script end to end.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"   # before any kernel is defined
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

if SMOKE:
    from kernel_checks import patch_triton_interpreter  # noqa: E402
    patch_triton_interpreter()

from zerod.engine.linear import Linear  # noqa: E402
from zerod.engine.quant import triton_fp8, triton_w8a16  # noqa: E402
from zerod.engine.quant.config import QuantConfig  # noqa: E402
from zerod.engine.quant.linear import W8A16_MAX_M, Fp8Linear  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/fp8_gemm"))
OUT.mkdir(parents=True, exist_ok=True)
DEV = torch.device("cpu" if SMOKE else "cuda")
ADT = torch.float16 if SMOKE else torch.bfloat16    # the interpreter's tl.dot takes fp16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(m) for m in os.environ.get("MS", "1,4,16,64,200,512,2048").split(",")]
if SMOKE:
    SHAPES = {"qkv": (384, 256), "o": (256, 256), "gate_up": (1024, 256), "down": (256, 512)}
    MS = [1, 16, 70]
COLD_BYTES = 256 << 20     # weight copies per graph: more than L2 (50 MB on an H200) several times
CHANNEL = QuantConfig("online", "channel", "token")
BLOCK = QuantConfig("fp8", "block", "token", block=(128, 128))
VARIANTS = ("bf16", "w8a8", "w8a16", "w8a8-blk", "w8a16-blk", "quant")
# W8A8 against the same activation quantization in float32 (the interpreter truncates
# to e4m3 where the GPU rounds: up to a step, 1/8); W8A16: exact products, a bf16 output
TOL = {"w8a8": 1.5e-1 if SMOKE else 2e-2, "w8a16": 5e-3}


def log(*a):
    print(*a, flush=True)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def layers(n: int, k: int) -> dict[str, list]:
    """Each variant's projection, in enough copies to read them cold."""
    g = torch.Generator(device=DEV).manual_seed(1)
    w = torch.randn(n, k, generator=g, device=DEV) / math.sqrt(k)
    out = {}
    for name, scheme in (("", CHANNEL), ("-blk", BLOCK)):
        lin = Fp8Linear(n, k, bias=False, dtype=ADT, device=DEV, scheme=scheme)
        lin.set_weight(w)
        out[name] = [lin] + [copy.deepcopy(lin) for _ in range(copies(n * k) - 1)]
    base = Linear(n, k, bias=False, dtype=ADT, device=DEV)
    base.weight.data.copy_(w)
    out["bf16"] = [base] + [copy.deepcopy(base) for _ in range(copies(n * k) - 1)]
    return out


def copies(fp8_bytes: int) -> int:
    return 1 if SMOKE else max(2, min(16, math.ceil(COLD_BYTES / fp8_bytes)))


def calls(lins: dict, variant: str, x: torch.Tensor) -> list:
    if variant == "bf16":
        return [lambda lin=lin: lin(x) for lin in lins["bf16"]]
    if variant == "quant":
        return [lambda: triton_fp8.quantize_tokens(x)] * len(lins[""])
    kind, blk = variant.split("-")[0], "-blk" if variant.endswith("-blk") else ""
    return [lambda lin=lin: getattr(lin, kind)(x) for lin in lins[blk]]


def time_us(fns: list) -> float:
    """Per-call time: on the GPU inside a CUDA graph of all the copies (run for ~1 ms),
    the median of 7 replays; SMOKE: one wall-clock pass."""
    for f in fns:
        f()    # compile, and cuBLASLt's choice, outside the capture
    if SMOKE:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) / len(fns) * 1e6
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for f in fns:
        f()
    b.record()
    b.synchronize()
    rounds = max(1, min(20, int(1.0 / max(a.elapsed_time(b), 1e-3))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in fns:
                f()
    g.replay()
    ts = []
    for _ in range(7):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(ts) / (rounds * len(fns))


def bytes_moved(variant: str, m: int, n: int, k: int) -> int:
    if variant == "quant":
        return m * k * 3 + m * 4
    w = n * k * (2 if variant == "bf16" else 1)
    return w + m * k * 2 + m * n * 2


def check(lins: dict, x: torch.Tensor) -> list[tuple[str, float, float]]:
    """Each FP8 product against Fp8Linear.reference in float32 (W8A16: without quantizing
    the activations)."""
    res = []
    for blk in ("", "-blk"):
        lin = lins[blk][0]
        for kind in ("w8a8", "w8a16"):
            ref = lin.reference(x.float(), quantize_activations=kind == "w8a8")
            res.append((kind + blk, rel(getattr(lin, kind)(x).float(), ref), TOL[kind]))
    return res


def threshold(per_layer: dict, fast: str, slow: str) -> int:
    """The largest M of the list up to which `fast` wins at every M (0: never)."""
    best = 0
    for m in MS:
        if per_layer[fast][m] > per_layer[slow][m]:
            break
        best = m
    return best


def main() -> int:
    info = {"device": torch.cuda.get_device_name(0) if not SMOKE else "cpu (Triton interpreter)",
            "torch": torch.__version__, "smoke": SMOKE, "current W8A16_MAX_M": W8A16_MAX_M}
    log(json.dumps(info))
    rows, sweep, bad = [], [], []
    g = torch.Generator(device=DEV).manual_seed(2)
    for shape, (n, k) in SHAPES.items():
        lins = layers(n, k)
        for m in MS:
            x = torch.randn(m, k, generator=g, device=DEV).to(ADT)
            if m in (MS[0], MS[-1]):
                for name, err, tol in check(lins, x):
                    log(f"check {shape} M={m} {name}: {err:.2e} (tol {tol:.2g}) {'ok' if err <= tol else 'BAD'}")
                    if not err <= tol:
                        bad.append((shape, m, name, err))
            if bad:
                break
            for v in VARIANTS:
                us = time_us(calls(lins, v, x))
                rows.append({"shape": shape, "M": m, "variant": v, "us": us,
                             "GB/s": bytes_moved(v, m, n, k) / us / 1e3})
        if bad:
            break
        for m in (1, 16) if not SMOKE else (1,):
            x = torch.randn(m, k, generator=g, device=DEV).to(ADT)
            lin = lins[""]
            for bn in (32, 64, 128):
                for bk in (128, 256):
                    fns = [lambda c=c: triton_w8a16.w8a16_matmul(x, c.weight, c.weight_scale, block_n=bn, block_k=bk)
                           for c in lins[""]]
                    us = time_us(fns)
                    sweep.append({"shape": shape, "M": m, "BLOCK_N": bn, "BLOCK_K": bk, "us": us,
                                  "GB/s": n * k / us / 1e3, "split": triton_w8a16.split_k(m, n, k, bn, bk,
                                                                                           triton_w8a16._sm_count(DEV))})
        del lins
        if not SMOKE:
            torch.cuda.empty_cache()
    result = {"info": info, "rows": rows, "sweep": sweep, "bad": bad}
    if bad:
        (OUT / "fp8_gemm.json").write_text(json.dumps(result, indent=1))
        log(f"FAILED checks, nothing timed after them: {bad}")
        return 1

    log("\nus per call (GB/s achieved) - CUDA graph, weights cold" if not SMOKE else "\nus per call (SMOKE: interpreter)")
    t = {(r["shape"], r["M"], r["variant"]): r for r in rows}
    log(f"{'shape':8} {'M':>5} " + " ".join(f"{v:>17}" for v in VARIANTS))
    for shape in SHAPES:
        for m in MS:
            cells = [f"{t[shape, m, v]['us']:8.1f} ({t[shape, m, v]['GB/s']:5.0f})" for v in VARIANTS]
            log(f"{shape:8} {m:>5} " + " ".join(f"{c:>17}" for c in cells))
    per_layer = {v: {m: sum(t[s, m, v]["us"] for s in SHAPES) for m in MS} for v in VARIANTS}
    # fused into the RMSNorm, the quantization before qkv and gate_up would go
    per_layer["fusable"] = {m: t["qkv", m, "quant"]["us"] + t["gate_up", m, "quant"]["us"] for m in MS}
    del per_layer["quant"]
    log("\nper layer (the four projections), us; fusable: the activation quant before qkv and gate_up")
    for m in MS:
        log(f"  M={m:>5} " + " ".join(f"{v}={us[m]:.1f}" for v, us in per_layer.items()))
    log("\nW8A16 tiles at small M (us, default BLOCK_N=%d BLOCK_K=%d)" % (triton_w8a16.BLOCK_N, triton_w8a16.BLOCK_K))
    for r in sweep:
        log(f"  {r['shape']:8} M={r['M']:>3} BLOCK_N={r['BLOCK_N']:>3} BLOCK_K={r['BLOCK_K']:>3} "
            f"split={r['split']:>2} {r['us']:8.1f} us {r['GB/s']:6.0f} GB/s")
    implied = {"row": threshold(per_layer, "w8a16", "w8a8"), "block": threshold(per_layer, "w8a16-blk", "w8a8-blk")}
    result["implied W8A16_MAX_M"] = implied
    log(f"\nimplied W8A16_MAX_M = {implied} (engine/quant/linear.py has {W8A16_MAX_M}; from M in {MS}: "
        f"to place it between two of them, rerun with MS=...)")
    (OUT / "fp8_gemm.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
