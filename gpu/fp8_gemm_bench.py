#!/usr/bin/env python3
"""The FP8 projections at the Llama-3-8B shapes on one GPU: which product is fastest at
which M (the step's tokens), and so Fp8Linear's W8A16_MAX_M (engine/quant/linear.py).

For qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336 and M in
(1, 4, 16, 64, 200, 512, 2048), through the engine's own code:
  bf16       the unquantized projection (engine/model/linear.py's Linear: F.linear)
  w8a8       per-channel weights: per-token activation quant + torch._scaled_mm (Fp8Linear.w8a8)
  w8a8t      the same through cuBLASLt's tensorwise FP8 GEMM with unit scales, the tokens'
             and the channels' scales on its float32 output after (Fp8Linear.w8a8_tensorwise)
  w8a8t16    the same with the GEMM's output in bf16 before the scales (a second rounding)
  w8a8f, w8a8tf  w8a8 and w8a8t with cuBLASLt's fast accumulation (Tuning.fp8_fast_accum,
             the engine's default: no promotion of the sums to float32; the other w8a8
             variants promote them), their error beside the promoted ones'
  w8a16      per-channel weights: the Triton W8A16 kernel "ab" (Fp8Linear.w8a16, x · Wᵀ tiles)
  sab        per-channel weights: the swap-AB W8A16 kernel "swap_ab" (yᵀ = W xᵀ), M <= 64 only
  w8a8-blk   128x128 block weights: per-token-group quant + the Triton block GEMM
  w8a16-blk  128x128 block weights: the "ab" W8A16 kernel with block scales
  sab-blk    128x128 block weights: the "swap_ab" kernel with block scales, M <= 64 only
and `quant`, the per-token activation quantization alone (part of w8a8's time): what
fusing it into the RMSNorm before qkv and gate_up would save at most, per projection.
Each FP8 product is checked against the dequantized float32 reference first (nothing is timed if one
fails), then timed inside a CUDA graph that cycles through enough copies of the weights
that none is in L2 when read (a decode step reads each layer's weights cold): median of
replays, per call. GB/s: the bytes a call must move (weights, scales, activations in,
output) over its time. Then the tile sweeps at M=1 and 16 (per-channel weights): "ab"'s
BLOCK_N x BLOCK_K, and "swap_ab"'s BLOCK_N x BLOCK_K x pipeline stages x warps (and its
hints off), each configuration checked before it is timed, one that does not compile
(shared memory) recorded and skipped.

Last, a short table: per layer (the four projections) bf16 against both W8A16 kernels (at
their default tiles and at the sweep's best), and the thresholds the sums imply, the
largest M of the list up to which W8A16 beats W8A8 at every M (and the tensorwise GEMM beats
row-wise above it: Tuning.fp8_tensorwise_max_m). Everything into
$OUT/fp8_gemm.json (also after each shape). About 2 min on an H200; SWEEP=0 skips the
sweeps; ONLY=w8a8,w8a8f,... times those variants alone. SMOKE=1: tiny shapes on the
CPU through Triton's interpreter (wall-clock, no graphs), to prove the script end to end.
"""

from __future__ import annotations

import copy
import dataclasses
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

from zerod.engine.model.linear import Linear  # noqa: E402
from zerod.engine.quant import triton_fp8, triton_w8a16  # noqa: E402
from zerod.engine.spec.quant import QuantConfig  # noqa: E402
from zerod.engine.quant.linear import W8A16_MAX_M, Fp8Linear  # noqa: E402
from zerod.engine.quant.triton_w8a16 import TILES, Tiles  # noqa: E402
from zerod.engine.tuning import Tuning  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/fp8_gemm"))
OUT.mkdir(parents=True, exist_ok=True)
DEV = torch.device("cpu" if SMOKE else "cuda")
ADT = torch.float16 if SMOKE else torch.bfloat16    # the interpreter's tl.dot takes fp16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(m) for m in os.environ.get("MS", "1,4,16,64,200,512,2048").split(",")]
SWEEP = os.environ.get("SWEEP", "1") == "1"
SWEEP_MS = (1, 16)
SAB_MAX_M = 64             # the swap-AB kernel is for decode sizes: timed up to this M
# "ab"'s sweep: 32 and 64 columns (128 are 14-89 % slower on the H200);
# "swap_ab"'s: the configurations that compile well for sm_90a
# (compiled ahead with Triton 3.6 and ptxas -v): within the 227 KB of shared memory (64x512
# at 3 stages, 128x512 at 3), no spills (128x512 with 4 warps spills), and no wgmma that
# ptxas serialises (128x256 with 4 warps); then the default with its hints off
AB_SWEEP = [Tiles(bn, bk) for bn in (32, 64) for bk in (128, 256)]
SAB_SWEEP = ([Tiles(64, bk, ns, 4, True) for bk in (128, 256) for ns in (3, 4, 5)]
             + [Tiles(64, 512, 3, 4, True), Tiles(64, 128, 4, 8, True), Tiles(64, 256, 4, 8, True),
                Tiles(128, 128, 4, 4, True)]
             + [Tiles(128, bk, ns, 8, True) for bk in (128, 256) for ns in (3, 4, 5)]
             + [Tiles(128, 512, 3, 8, True), dataclasses.replace(TILES["swap_ab"], hints=False)])
if SMOKE:
    SHAPES = {"qkv": (384, 256), "o": (256, 256), "gate_up": (1024, 256), "down": (256, 512)}
    MS = [1, 16, 70]
    SWEEP_MS = (1,)
    AB_SWEEP, SAB_SWEEP = AB_SWEEP[:1], [TILES["swap_ab"], Tiles(128, 128, 3, 8)]
COLD_BYTES = 256 << 20     # weight copies per graph: more than L2 (50 MB on an H200) several times
CHANNEL = QuantConfig("online", "channel", "token")
BLOCK = QuantConfig("fp8", "block", "token", block=(128, 128))
VARIANTS = ("bf16", "w8a8", "w8a8t", "w8a8t16", "w8a8f", "w8a8tf", "w8a16", "sab", "w8a8-blk", "w8a16-blk",
            "sab-blk", "quant")
if os.environ.get("ONLY"):
    _only = os.environ["ONLY"].split(",")
    if set(_only) - set(VARIANTS):
        sys.exit(f"ONLY: no variant {sorted(set(_only) - set(VARIANTS))}; the variants are {', '.join(VARIANTS)}")
    VARIANTS = tuple(v for v in VARIANTS if v in _only)
FAST = {"w8a8f": "w8a8", "w8a8tf": "w8a8t"}   # fast accumulation's variants, and their promoted twins
KERNEL = {"w8a16": "ab", "sab": "swap_ab"}   # the W8A16 variants' kernels (triton_w8a16)
# W8A8 against the same activation quantization in float32 (the interpreter truncates
# to e4m3 where the GPU rounds: up to a step, 1/8); W8A16: exact products, a bf16 output
TOL = {"w8a8": 1.5e-1 if SMOKE else 2e-2, "w8a8t": 1.5e-1 if SMOKE else 2e-2, "w8a8t16": 2e-2,
       "w8a8f": 2e-2, "w8a8tf": 2e-2, "w8a16": 5e-3, "sab": 5e-3}


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


def timed(variant: str, m: int) -> bool:
    if variant.startswith("w8a8t") or variant in FAST:   # cuBLASLt: no CPU form
        return not SMOKE
    return m <= SAB_MAX_M or not variant.startswith("sab")


def calls(lins: dict, variant: str, x: torch.Tensor) -> list:
    if variant == "bf16":
        return [lambda lin=lin: lin(x) for lin in lins["bf16"]]
    if variant == "quant":
        return [lambda: triton_fp8.quantize_tokens(x)] * len(lins[""])
    kind, blk = variant.split("-")[0], "-blk" if variant.endswith("-blk") else ""
    if kind.startswith("w8a8"):
        return [lambda lin=lin: product(lin, kind, x) for lin in lins[blk]]
    return [lambda lin=lin: lin.w8a16(x, KERNEL[kind]) for lin in lins[blk]]


def product(lin: Fp8Linear, kind: str, x: torch.Tensor) -> torch.Tensor:
    """One of the W8A8 products: the fast-accumulation variants with fast accumulation, the
    others with the sums promoted to float32, whatever the engine's default."""
    default = lin.tuning
    lin.tuning = dataclasses.replace(default, fp8_fast_accum=kind in FAST)
    kind = FAST.get(kind, kind)
    try:
        return (lin.w8a8(x) if kind == "w8a8" else lin.w8a8_tensorwise(x) if kind == "w8a8t"
                else lin.w8a8_tensorwise(x, torch.bfloat16))
    finally:
        lin.tuning = default


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
        for kind in ("w8a8", "w8a8t", "w8a8t16", "w8a8f", "w8a8tf", "w8a16", "sab"):
            if kind + blk not in VARIANTS or not timed(kind, x.shape[0]):
                continue
            ref = lin.reference(x.float(), quantize_activations=kind.startswith("w8a8"))
            y = product(lin, kind, x) if kind.startswith("w8a8") else lin.w8a16(x, KERNEL[kind])
            res.append((kind + blk, rel(y.float(), ref), TOL[kind]))
    return res


def sweep(lins: dict, shape: str, n: int, k: int, g: torch.Generator) -> list[dict]:
    """Both W8A16 kernels' tiles on the per-channel weights: each configuration checked
    against the reference, then timed (one that fails to compile: its error, untimed)."""
    rows = []
    for m in SWEEP_MS:
        x = torch.randn(m, k, generator=g, device=DEV).to(ADT)
        ref = lins[""][0].reference(x.float(), quantize_activations=False)
        for kernel, configs in (("ab", AB_SWEEP), ("swap_ab", SAB_SWEEP)):
            for t in configs:
                row = {"shape": shape, "M": m, "kernel": kernel, "tiles": dataclasses.asdict(t),
                       "split": triton_w8a16.split_k(m, n, k, t.block_n, t.block_k, triton_w8a16._sm_count(DEV))}
                mm = lambda c, t=t: triton_w8a16.w8a16_matmul(x, c.weight, c.weight_scale,  # noqa: E731
                                                             kernel=kernel, tiles=t)
                try:
                    row["err"] = rel(mm(lins[""][0]).float(), ref)
                    if row["err"] <= TOL["w8a16"]:
                        row["us"] = time_us([lambda c=c: mm(c) for c in lins[""]])
                        row["GB/s"] = n * k / row["us"] / 1e3
                except Exception as e:   # out of shared memory on this GPU, a compiler error
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
    return rows


def label(t: dict, kernel: str) -> str:
    hints = " hints" if t["hints"] and kernel == "swap_ab" else ""   # only swap_ab has them
    return f"{t['block_n']:>3}x{t['block_k']:<3} s{t['num_stages']} w{t['num_warps']}{hints}"


def best_tiles(rows: list[dict], kernel: str) -> dict[int, tuple[str, float]]:
    """Per M of the sweep, the configuration with the least time summed over the layer's
    projections (timed at every shape), and that time."""
    out = {}
    for m in SWEEP_MS:
        per = {}
        for r in rows:
            if r["kernel"] == kernel and r["M"] == m and "us" in r:
                per.setdefault(label(r["tiles"], kernel), []).append(r["us"])
        whole = {lab: sum(us) for lab, us in per.items() if len(us) == len(SHAPES)}
        if whole:
            lab = min(whole, key=whole.get)
            out[m] = (lab, whole[lab])
    return out


def threshold(per_layer: dict, fast: str, slow: str) -> int:
    """The largest M of the list up to which `fast` wins at every M (0: never)."""
    best = 0
    for m in MS:
        if m not in per_layer[fast] or per_layer[fast][m] > per_layer[slow][m]:
            break
        best = m
    return best


def main() -> int:
    info = {"device": torch.cuda.get_device_name(0) if not SMOKE else "cpu (Triton interpreter)",
            "torch": torch.__version__, "smoke": SMOKE, "current W8A16_MAX_M": W8A16_MAX_M,
            "W8A16 KERNEL": triton_w8a16.KERNEL, "TILES": {k: dataclasses.asdict(t) for k, t in TILES.items()}}
    log(json.dumps(info))
    rows, sweeps, bad, checks = [], [], [], []
    result = {"info": info, "rows": rows, "sweep": sweeps, "bad": bad, "checks": checks}   # saved after each shape
    g = torch.Generator(device=DEV).manual_seed(2)
    t0 = time.perf_counter()
    for shape, (n, k) in SHAPES.items():
        lins = layers(n, k)
        for m in MS:
            x = torch.randn(m, k, generator=g, device=DEV).to(ADT)
            if m in (MS[0], MS[-1], max((m_ for m_ in MS if m_ <= SAB_MAX_M), default=0)):
                for name, err, tol in check(lins, x):
                    checks.append((shape, m, name, err))
                    log(f"check {shape} M={m} {name}: {err:.2e} (tol {tol:.2g}) {'ok' if err <= tol else 'BAD'}")
                    if not err <= tol:
                        bad.append((shape, m, name, err))
            if bad:
                break
            for v in VARIANTS:
                if timed(v, m):
                    us = time_us(calls(lins, v, x))
                    rows.append({"shape": shape, "M": m, "variant": v, "us": us,
                                 "GB/s": bytes_moved(v, m, n, k) / us / 1e3})
        if bad:
            break
        if SWEEP:
            sweeps += sweep(lins, shape, n, k, g)
        log(f"{shape} done at {time.perf_counter() - t0:.0f} s")
        (OUT / "fp8_gemm.json").write_text(json.dumps(result, indent=1))
        del lins
        if not SMOKE:
            torch.cuda.empty_cache()
    if bad:
        (OUT / "fp8_gemm.json").write_text(json.dumps(result, indent=1))
        log(f"FAILED checks, nothing timed after them: {bad}")
        return 1

    log("\nus per call (GB/s achieved) - CUDA graph, weights cold" if not SMOKE else "\nus per call (SMOKE: interpreter)")
    t = {(r["shape"], r["M"], r["variant"]): r for r in rows}
    log(f"{'shape':8} {'M':>5} " + " ".join(f"{v:>16}" for v in VARIANTS))
    for shape in SHAPES:
        for m in MS:
            cells = [f"{t[shape, m, v]['us']:7.1f} ({t[shape, m, v]['GB/s']:5.0f})" if (shape, m, v) in t else "-"
                     for v in VARIANTS]
            log(f"{shape:8} {m:>5} " + " ".join(f"{c:>16}" for c in cells))
    per_layer = {v: {m: sum(t[s, m, v]["us"] for s in SHAPES) for m in MS if timed(v, m)} for v in VARIANTS}
    if "quant" in per_layer:   # fused into the RMSNorm, the quantization before qkv and gate_up would go
        per_layer["fusable"] = {m: t["qkv", m, "quant"]["us"] + t["gate_up", m, "quant"]["us"] for m in MS}
        del per_layer["quant"]
    log("\nper layer (the four projections), us; fusable: the activation quant before qkv and gate_up")
    for m in MS:
        log(f"  M={m:>5} " + " ".join(f"{v}={us[m]:.1f}" for v, us in per_layer.items() if m in us))
    fast = [(f, p) for f, p in FAST.items() if per_layer.get(f) and per_layer.get(p)]
    if fast:
        log("\nfast accumulation (Tuning.fp8_fast_accum) against promoted sums: a layer's us, and the"
            " worst error of the checks against the float32 reference")
        for f, p in fast:
            errs = {name: max(e for _, _, n_, e in checks if n_ == name) for name in (f, p)
                    if any(n_ == name for _, _, n_, _ in checks)}
            log(f"  {p:>6}: " + ", ".join(f"M={m} {per_layer[p][m]:.1f} -> {per_layer[f][m]:.1f} "
                                          f"({per_layer[p][m] / per_layer[f][m]:.2f}x)" for m in MS if m in per_layer[f])
                + "; error " + " -> ".join(f"{errs[n]:.2e}" for n in (p, f) if n in errs))
    if os.environ.get("ONLY"):   # the thresholds below need every variant
        return 0

    best = {}
    if sweeps:
        log("\nW8A16 tiles, per-channel weights (us, GB/s of the weights; defaults: "
            + ", ".join(f"{k} {label(dataclasses.asdict(v), k)}" for k, v in TILES.items()) + ")")
        for r in sweeps:
            what = (f"{r['us']:8.1f} us {r['GB/s']:6.0f} GB/s" if "us" in r
                    else r.get("error") or f"BAD: {r['err']:.2e} against the reference")
            log(f"  {r['shape']:8} M={r['M']:>3} {r['kernel']:7} {label(r['tiles'], r['kernel'])} "
                f"split={r['split']:>2} {what}")
        best = {kernel: best_tiles(sweeps, kernel) for kernel in ("ab", "swap_ab")}
        result["best tiles"] = best

    implied = {"row": threshold(per_layer, "w8a16", "w8a8"), "block": threshold(per_layer, "w8a16-blk", "w8a8-blk"),
               "row swap_ab": threshold(per_layer, "sab", "w8a8"),
               "block swap_ab": threshold(per_layer, "sab-blk", "w8a8-blk")}
    result["implied W8A16_MAX_M"] = implied
    # Tuning.fp8_tensorwise_max_m: from above W8A16's rows, the largest M of the list up to
    # which the tensorwise GEMM beats row-wise at every M
    above = [m for m in MS if m > W8A16_MAX_M["row"]]
    tw = 0
    for m in above:
        if m not in per_layer["w8a8t"] or per_layer["w8a8t"][m] > per_layer["w8a8"][m]:
            break
        tw = m
    result["implied fp8_tensorwise_max_m"] = tw
    (OUT / "fp8_gemm.json").write_text(json.dumps(result, indent=1))

    # the short table: a layer's weights at each kernel's speed
    wbytes = {v: sum(n * k * size for n, k in SHAPES.values()) for v, size in (("bf16", 2), ("w8a16", 1))}
    def cell(us: float | None, v: str = "w8a16") -> str:
        return f"{us:7.1f} ({wbytes[v] / us / 1e3:5.0f})" if us else "-"
    log(f"\nper layer at small M, us (GB/s of the weights); KERNEL = {triton_w8a16.KERNEL!r}, "
        f"W8A16_MAX_M = {W8A16_MAX_M}")
    log(f"  {'M':>3} {'bf16':>15} {'w8a8':>15} {'ab':>15} {'swap_ab':>15} {'ab best':>15} {'swap_ab best':>15}")
    for m in [m for m in MS if m <= SAB_MAX_M]:
        b = {k: best.get(k, {}).get(m, (None, None))[1] for k in ("ab", "swap_ab")}
        log(f"  {m:>3} {cell(per_layer['bf16'][m], 'bf16'):>15} {cell(per_layer['w8a8'][m]):>15} "
            f"{cell(per_layer['w8a16'][m]):>15} {cell(per_layer['sab'][m]):>15} {cell(b['ab']):>15} "
            f"{cell(b['swap_ab']):>15}")
    if 1 in per_layer.get("w8a8t", {}):
        log(f"    1 tensorwise W8A8 (quant + cuBLASLt + the column scales): {cell(per_layer['w8a8t'][1]):>15}")
    for kernel, per_m in best.items():
        log(f"  best {kernel} tiles: " + ", ".join(f"M={m}: {lab}" for m, (lab, _) in per_m.items()))
    log(f"implied W8A16_MAX_M = {implied} (engine/quant/linear.py has {W8A16_MAX_M}; from M in {MS}: "
        f"to place it between two of them, rerun with MS=...)")
    log(f"implied Tuning.fp8_tensorwise_max_m = {tw} (the engine's default: {Tuning().fp8_tensorwise_max_m})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
