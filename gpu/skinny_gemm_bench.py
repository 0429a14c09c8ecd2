#!/usr/bin/env python3
"""The skinny GEMM candidates (engine/kernels/skinny_gemm.py) against cuBLAS at the
Llama-3-8B shapes, on one GPU: which config is fastest per shape and M, and how close each
side runs to its roofline bound.

    python3 gpu/skinny_gemm_bench.py --out $OUT/skinny.json        # the sweep
    python3 gpu/skinny_gemm_bench.py --out $OUT/skinny.json --quick   # o and gate_up only
    python3 gpu/skinny_gemm_bench.py --interpret --out /tmp/s.json    # dry run on the CPU
    python3 gpu/skinny_gemm_bench.py --aot --out /tmp/aot.json        # sm_90a compile, no GPU

Shapes (N x K): qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, and the
LM head 128256x4096 (bf16 only: the engine keeps the LM head unquantized), at M in
1, 16, 64, 128, 200, 256 (`--ms`, `--shapes`, `--dtypes` pick fewer). bf16: every
CONFIGS["half"] entry against F.linear. fp8 (where float8_e4m3fn and torch._scaled_mm run:
sm_89+): every CONFIGS["fp8"] entry against torch._scaled_mm with per-token A and
per-channel B scales, as Fp8Linear.w8a8 calls it; both take the same quantized activations
(the quantization itself is not timed).

Each result is first checked against a float32 reference (the fp8 one from the
dequantized operands): a relative error above TOL, a NaN, or a launch that fails (out of
shared memory, a compiler error) excludes that config however fast; the error against
cuBLAS's output is recorded too. One within 10x TOL is still timed, never picked (the
FP8 "fast" configs, whose sums are never promoted, show what their precision costs).

Then timed: on the GPU inside a CUDA graph that cycles through copies of the weights,
COLD_BYTES in all (several times the H200's 50-60 MB L2), so that every call reads its
weights from HBM, as a decode step does: o's weights (34 MB bf16, 17 MB fp8), qkv's and
fp8 down's would otherwise stay in the L2 between back-to-back calls and time faster
than any decode step runs them, while gate_up's and the LM head's (and bf16 down's)
exceed it anyway and get one to three copies. The activations stay in the L2, as they
do after the kernel that wrote them. The median of 7 replays of ~1 ms, per call, launch
gaps excluded (a decode step replays graphs too); the graph also proves the launches
capturable. Each is set against its roofline bound max(bytes / HBM, FLOPs / peak), with
gpu/step_breakdown.py's H200 figures (diag's copy bandwidth and checked GEMM peaks); the
bytes are those a call must move: weights, activations, output, and the FP8 scales.

Prints a table (shape, M, cuBLAS us and % of bound, the best Triton config's, the speedup)
and, per dtype and M, a decode step's GEMMs (32 layers of the four projections + the bf16
LM head) with cuBLAS against the faster of the two per shape. Writes every row to --out
(after each cell, so a cut-short run keeps what it measured) and the per-shape best
config to --table-out (default: --out's name with _table), for a later change to load
at engine start.

Runtime on an H200: Triton compiles each config once per dtype (M is no specialisation
key; N, K and the strides share one): 39 GEMM kernels plus the split-K sums and stream-K
fixups, ~15 s for all of them on a 2-core CPU (--aot), so well under a minute there. Then
54 cells (M = 200 first, then the larger M before the smaller) of 20-21 timings each (the
configs and cuBLAS), ~10-50 ms a timing: a few minutes in all (--quick: 24 cells).
--budget-s (default 360) stops starting new cells past it and says so (`stopped_early`),
so one device call of 10 minutes ends with its files.

--interpret: TRITON_INTERPRET=1, tiny shapes on the CPU, fp16 in place of bf16 (the
interpreter's tl.dot on bf16 is wrong) and the interpreter's wall-clock, to exercise the
script end to end; its times say nothing about a GPU.

--aot: no GPU either: every config compiled ahead for sm_90a (Triton's own ptxas, -v),
one line each: shared memory, registers, spills, the MMA instructions (wgmma or
mma.sync) and any ptxas performance warning; to prune configs without device time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from step_breakdown import HBM, PEAK  # noqa: E402  (H200: diag's copy bandwidth, GEMM peaks)
from graph_timing import replay_ms  # noqa: E402
from sweep_device import SweepResult, machine, sweep_device  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
QUICK = ("o", "gate_up")
MS = (1, 16, 64, 128, 200, 256)
BF16_ONLY = ("lm_head",)
LAYERS = 32
# tiny stand-ins for --interpret: N and K past a tile, M in and past a 16-token tile
INTERPRET_SHAPES = {"qkv": (96, 320), "o": (64, 128), "gate_up": (160, 128), "down": (64, 384), "lm_head": (200, 128)}
INTERPRET_MS = (1, 5, 33)
# relative error (Frobenius) against float32: bf16's rounding is ~1e-3; FP8 products are
# exact, their sums on Hopper keep ~14 bits; a wrong tile or index costs O(1)
TOL = {"bf16": 5e-3, "fp8": 1e-2}
COLD_BYTES = 256 << 20   # weight copies per timing: several times an H200's L2
MAX_COPIES = 16
ELT = {"bf16": 2, "fp8": 1}   # bytes of a weight or an activation
PRIORITY_M = 200             # the throughput scenario's batch: measured first


def cells(shapes: list[str], dtypes: list[str], ms: list[int]) -> list[tuple[int, str, str]]:
    """(M, shape, dtype) in the order they are measured: M = PRIORITY_M first, then the
    larger M before the smaller, so a run cut short by --budget-s keeps what matters most."""
    order = sorted(ms, key=lambda m: (m != PRIORITY_M, -m))
    return [(m, s, d) for m in order for s in shapes for d in dtypes if not (d == "fp8" and s in BF16_ONLY)]


def bound_us(dtype: str, m: int, n: int, k: int) -> float:
    """The roofline bound of one call, us: max(bytes / HBM, FLOPs / peak); bytes: the
    weights and activations (bf16, or e4m3 with float32 scales) and a bf16 output."""
    elt = ELT[dtype]
    moved = n * k * elt + m * k * elt + m * n * 2 + (4 * (m + n) if dtype == "fp8" else 0)
    return 1e6 * max(moved / HBM, 2 * m * n * k / PEAK[dtype])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "skinny.json"),
                    help="every row as JSON (default $OUT/skinny.json)")
    ap.add_argument("--table-out", help="the best config per dtype, shape and M (default: --out with _table)")
    ap.add_argument("--quick", action="store_true", help=f"shapes {' and '.join(QUICK)} only")
    ap.add_argument("--shapes", help=f"comma-separated, of {','.join(SHAPES)}")
    ap.add_argument("--ms", help=f"comma-separated M values (default {','.join(map(str, MS))})")
    ap.add_argument("--dtypes", default="bf16,fp8", help="bf16, fp8 or both")
    ap.add_argument("--max-configs", type=int, default=0, help="the first N configs of each dtype (0: all)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="start no new cell after this many seconds")
    ap.add_argument("--interpret", action="store_true", help="the CPU through Triton's interpreter, tiny shapes")
    ap.add_argument("--aot", action="store_true", help="compile every config for sm_90a on the CPU, report ptxas -v")
    a = ap.parse_args(argv)
    names = a.shapes.split(",") if a.shapes else list(QUICK if a.quick else SHAPES)
    if any(s not in SHAPES for s in names):
        ap.error(f"--shapes: one of {','.join(SHAPES)}, got {a.shapes}")
    a.shapes = names
    a.ms = [int(m) for m in a.ms.split(",")] if a.ms else list(INTERPRET_MS if a.interpret else MS)
    a.dtypes = a.dtypes.split(",")
    if any(d not in TOL for d in a.dtypes):
        ap.error(f"--dtypes: bf16 and / or fp8, got {a.dtypes}")
    if a.table_out is None:
        p = Path(a.out)
        a.table_out = str(p.with_name(p.stem + "_table" + (p.suffix or ".json")))
    return a


# --------------------------------------------------------------------------- results

def best_per_cell(rows: list[dict]) -> dict:
    """{dtype: {"NxK": {"M": best checked Triton row against cuBLAS}}}: wrong or failed
    rows never win."""
    best: dict = {}
    base = {(r["dtype"], r["N"], r["K"], r["M"]): r for r in rows if r["impl"] == "cublas" and "us" in r}
    for r in rows:
        if r["impl"] != "triton" or not r.get("ok") or "us" not in r:
            continue
        cell = best.setdefault(r["dtype"], {}).setdefault(f"{r['N']}x{r['K']}", {})
        key = str(r["M"])
        if key in cell and cell[key]["triton_us"] <= r["us"]:
            continue
        b = base.get((r["dtype"], r["N"], r["K"], r["M"]))
        cell[key] = {"shape": r["shape"], "config": r["config"], "name": r["name"], "triton_us": r["us"],
                     "triton_of_bound": r["bound_us"] / r["us"],
                     "cublas_us": b["us"] if b else None, "cublas_of_bound": b["bound_us"] / b["us"] if b else None,
                     "speedup": b["us"] / r["us"] if b else None}
    return best


def table_lines(rows: list[dict], best: dict) -> list[str]:
    """The short table: per dtype, shape and M, cuBLAS against the best Triton config."""
    out = [f"{'dtype':5} {'shape':8} {'N x K':>12} {'M':>4} {'cuBLAS us (bound)':>19} "
           f"{'Triton us (bound)':>19} {'speedup':>7}  best config"]
    order = list(SHAPES)
    seen = sorted({(r["dtype"], r["shape"], r["N"], r["K"], r["M"]) for r in rows if r["impl"] == "cublas"},
                  key=lambda c: (c[0], order.index(c[1]) if c[1] in order else len(order), c[1], c[4]))
    for dtype, shape, n, k, m in seen:
        cell = best.get(dtype, {}).get(f"{n}x{k}", {}).get(str(m))
        base = next(r for r in rows
                    if r["impl"] == "cublas" and (r["dtype"], r["N"], r["K"], r["M"]) == (dtype, n, k, m))
        cub = f"{base['us']:8.1f} ({100 * base['bound_us'] / base['us']:3.0f} %)" if "us" in base else "failed"
        tri = f"{cell['triton_us']:8.1f} ({100 * cell['triton_of_bound']:3.0f} %)" if cell else "none correct"
        sp = f"{cell['speedup']:6.2f}x" if cell and cell["speedup"] else "-"
        out.append(f"{dtype:5} {shape:8} {f'{n}x{k}':>12} {m:>4} {cub:>19} {tri:>19} {sp:>7}  "
                   f"{cell['name'] if cell else '-'}")
    return out


def step_lines(rows: list[dict], best: dict) -> list[str]:
    """Per dtype and M: a decode step's GEMMs (LAYERS x the four projections + the bf16 LM
    head) with cuBLAS alone, and with the faster of cuBLAS and the best Triton per shape."""
    base = {(r["dtype"], r["shape"], r["M"]): r for r in rows if r["impl"] == "cublas" and "us" in r}
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for m in sorted({r["M"] for r in rows}):
            parts = [(s, LAYERS) for s in ("qkv", "o", "gate_up", "down")] + [("lm_head", 1)]
            cells = []
            for s, times in parts:
                d = "bf16" if s in BF16_ONLY else dtype
                b = base.get((d, s, m))
                if b is None:
                    break
                t = best.get(d, {}).get(f"{b['N']}x{b['K']}", {}).get(str(m))
                cells.append((times * b["us"], times * min(b["us"], t["triton_us"] if t else math.inf),
                              times * b["bound_us"]))
            else:
                cub, mixed, bound = (sum(c[i] for c in cells) for i in range(3))
                out.append(f"{dtype:5} M={m:>4}: cuBLAS {cub:8.0f} us ({100 * bound / cub:3.0f} % of bound), "
                           f"best of both {mixed:8.0f} us ({100 * bound / mixed:3.0f} %), bound {bound:6.0f} us")
    return out


# --------------------------------------------------------------------------- the device part

def run(a: argparse.Namespace) -> int:
    found = sweep_device(a.interpret)
    if found is None:
        return 2
    torch, dev, half = found
    import torch.nn.functional as F

    from zerod.engine.kernels import skinny_gemm as sg
    from zerod.engine.quant import fp8

    shapes = {s: (INTERPRET_SHAPES if a.interpret else SHAPES)[s] for s in a.shapes}
    info = {**machine(torch, dev, a.interpret), "hbm_Bps": HBM, "peak_flops": PEAK, "tol": TOL,
            "shapes": shapes, "ms": a.ms,
            "timing": "interpreter wall-clock, median of 3 calls" if a.interpret else
                      "CUDA graph over cold weight copies, median of 7 replays, per call"}
    if not a.interpret:
        p = torch.cuda.get_device_properties(dev)
        info.update(sms=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None),
                    capability=list(torch.cuda.get_device_capability(dev)))
    dtypes = list(a.dtypes)
    if "fp8" in dtypes:
        why = fp8_unsupported(torch, dev)
        if why:
            print(f"fp8 skipped: {why}", flush=True)
            info["fp8_skipped"] = why
            dtypes.remove("fp8")
    configs = {d: sg.CONFIGS["fp8" if d == "fp8" else "half"] for d in dtypes}
    if a.max_configs:
        configs = {d: c[:a.max_configs] for d, c in configs.items()}
    info["configs"] = {d: [c.name for c in cs] for d, cs in configs.items()}
    print(json.dumps(info), flush=True)

    result = SweepResult(a.out, info, a.budget_s)
    rows = result.rows
    g = torch.Generator(device=dev).manual_seed(11)

    def timed(fns: list) -> float:
        if a.interpret:
            ts = []
            for f in fns[:1] * 3:
                s = time.perf_counter()
                f()
                ts.append(time.perf_counter() - s)
            return statistics.median(ts) * 1e6
        return graph_time_us(torch, fns)

    weights: dict = {}

    def weights_of(shape: str, dtype: str):
        """(copies enough to read cold, the float32 weights the reference uses), made once."""
        if (shape, dtype) not in weights:
            n, k = shapes[shape]
            copies = 1 if a.interpret else max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / (n * k * ELT[dtype]))))
            w = (torch.randn(n, k, generator=g, device=dev) / math.sqrt(k)).to(half)
            if dtype == "fp8":
                wq, ws = fp8.quantize_rows(w)
                weights[shape, dtype] = ([(wq, ws)] + [(wq.clone(), ws.clone()) for _ in range(copies - 1)],
                                         wq.float() * ws[:, None])
            else:
                weights[shape, dtype] = ([w] + [w.clone() for _ in range(copies - 1)], w.float())
        return weights[shape, dtype]

    fatal = None
    for m, shape, dtype in cells(list(shapes), dtypes, a.ms):
        if result.over_budget():
            break
        n, k = shapes[shape]
        ws_, wref = weights_of(shape, dtype)
        x = torch.randn(m, k, generator=g, device=dev).to(half)
        if dtype == "fp8":
            xq, xs = fp8.quantize_rows(x)
            xs = xs[:, None]
            ref = (xq.float() * xs) @ wref.T
            base = [lambda c=c: torch._scaled_mm(xq, c[0].t(), scale_a=xs, scale_b=c[1].view(1, -1),
                                                 out_dtype=half) for c in ws_]
            mk = lambda cfg: [lambda c=c: sg.skinny_matmul_fp8(xq, xs, c[0], c[1], out_dtype=half,  # noqa: E731
                                                               cfg=cfg) for c in ws_]
        else:
            ref = x.float() @ wref.T
            base = [lambda c=c: F.linear(x, c) for c in ws_]
            mk = lambda cfg: [lambda c=c: sg.skinny_matmul(x, c, cfg=cfg) for c in ws_]  # noqa: E731
        common = {"dtype": dtype, "shape": shape, "N": n, "K": k, "M": m, "bound_us": bound_us(dtype, m, n, k)}
        cub = measure(torch, dict(common, impl="cublas", name="cuBLAS", config=None), base, ref, None,
                      TOL[dtype], timed)
        rows.append(cub)
        fatal = cub.get("fatal")
        cub_out = base[0]() if "error" not in cub else None
        mine = []
        for cfg in configs[dtype] if not fatal else ():
            r = measure(torch, dict(common, impl="triton", name=cfg.name, config=cfg.as_dict()),
                        mk(cfg), ref, cub_out, TOL[dtype], timed)
            mine.append(r)
            fatal = r.get("fatal")
            if fatal:
                break
        rows.extend(mine)
        line = f"{dtype} {shape} M={m}: cuBLAS {cub.get('us', float('nan')):.1f} us"
        good = [r for r in mine if r.get("ok") and "us" in r]
        if good:
            b = min(good, key=lambda r: r["us"])
            line += f", best Triton {b['us']:.1f} us ({b['name']})"
        print(f"{line}, {len(good)}/{len(configs[dtype])} configs right, {result.elapsed():.0f} s",
              flush=True)
        result.save()
        if fatal:
            break
    weights.clear()
    best = best_per_cell(rows)
    result.doc["best"] = best
    result.finish(fatal)
    Path(a.table_out).write_text(json.dumps({"info": info, "best": best}, indent=1))
    print("\n" + ("times: the interpreter's wall-clock, not a GPU's\n" if a.interpret else "") +
          "\n".join(table_lines(rows, best)))
    steps = step_lines(rows, best)
    if steps:
        print(f"\na decode step's GEMMs ({LAYERS} layers x qkv, o, gate_up, down + the bf16 LM head):")
        print("\n".join(steps))
    firsts = {}
    for r in rows:   # a config's first call compiles it (M is no specialisation key)
        if r["impl"] == "triton" and "first_call_s" in r:
            firsts.setdefault((r["dtype"], r["name"]), r["first_call_s"])
    print(f"\nfirst calls of the {len(firsts)} Triton configs (their compiles): {sum(firsts.values()):.0f} s")
    bad = [r for r in rows if not r.get("ok")]
    print(f"{len(rows)} rows, {len(bad)} excluded (wrong or failed); {a.out}, {a.table_out}; "
          f"{result.elapsed():.0f} s", flush=True)
    return 1 if fatal else 0


def fp8_unsupported(torch, dev) -> str | None:
    """Why the FP8 half cannot run here (None: it can)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return "this torch has no float8_e4m3fn / _scaled_mm"
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return "FP8 tensor cores need compute capability 8.9+"
    try:
        a = torch.ones(16, 32, device=dev).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=dev), scale_b=torch.ones(1, 16, device=dev),
                         out_dtype=torch.bfloat16)
    except Exception as e:   # a build without row-wise scaling
        return f"torch._scaled_mm row-wise: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def measure(torch, row: dict, fns: list, ref, cub_out, tol: float, timed) -> dict:
    """Check fns[0]'s output against ref (and cuBLAS's), then time all fns; a failure is
    recorded, not raised. row["fatal"]: the CUDA context no longer works."""
    try:
        t = time.perf_counter()
        y = fns[0]().float()
        if ref.is_cuda:
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t   # compile time included
        finite = bool(torch.isfinite(y).all())
        row["rel_err"] = float((y.double() - ref.double()).norm() / ref.double().norm()) if finite else math.inf
        row["max_abs"] = float((y - ref).abs().max()) if finite else math.inf
        if cub_out is not None:
            row["max_abs_vs_cublas"] = float((y - cub_out.float()).abs().max()) if finite else math.inf
            row["rel_vs_cublas"] = (float((y.double() - cub_out.double()).norm() / cub_out.double().norm())
                                    if finite else math.inf)
        row["ok"] = finite and row["rel_err"] <= tol
        # within 10x the tolerance: timed too (what FP8's unpromoted sums save shows), never picked
        if row["ok"] or row["impl"] == "cublas" or (finite and row["rel_err"] <= 10 * tol):
            row["us"] = timed(fns)
            row["of_bound"] = row["bound_us"] / row["us"]
    except Exception as e:   # out of shared memory, a compiler error, a capture that fails
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if ref.is_cuda:
            try:
                torch.cuda.synchronize()
            except Exception as e2:   # a sticky error (an illegal address): nothing after it is trusted
                row["fatal"] = f"{type(e2).__name__}: {(str(e2).splitlines() or [''])[0][:200]}"
    return row


def graph_time_us(torch, fns: list) -> float:
    """Per call: fns (one per weight copy) captured in a CUDA graph, repeated to ~1 ms of
    GPU time (a one-round graph's replay says how many rounds), the median of 7 replays."""
    for f in fns:
        f()   # compiled, and cuBLAS's choice made, outside the capture
    torch.cuda.synchronize()

    def capture(rounds: int):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(rounds):
                for f in fns:
                    f()
        g.replay()   # the first replay uploads the graph
        return g

    g = capture(1)
    rounds = max(1, min(20, int(1.0 / max(replay_ms(torch, g, 3), 1e-3))))
    if rounds > 1:
        del g
        g = capture(rounds)
    us = replay_ms(torch, g, 7) * 1e3 / (rounds * len(fns))
    del g
    return us


# --------------------------------------------------------------------------- ahead of time

AOT_DIVISIBLE = ("x_ptr", "w_ptr", "y_ptr", "xs_ptr", "ws_ptr", "b_ptr", "p_ptr", "N", "K", "K_SPLIT",
                 "stride_xm", "stride_wn", "stride_ym", "stride_ys")


def aot_compile(fn, dtype: str, consts: dict, options: dict, partial: bool = False):
    """fn compiled for sm_90a as the device's JIT would at the 8B shapes: pointers, N, K and
    the row strides 16-divisible, the scales' stride 1 (a constant), bf16 out (float32
    split-K partials when `partial`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    elt = "*fp8e4nv" if dtype == "fp8" else "*bf16"
    consts = dict(consts)
    sig = {}
    for p in fn.params:
        n = p.name
        if n in ("stride_xs", "stride_ws"):
            sig[n], consts[n] = "constexpr", 1
        elif p.is_constexpr:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = {"x_ptr": elt, "w_ptr": elt, "b_ptr": "*bf16",
                      "y_ptr": "*fp32" if partial else "*bf16"}.get(n, "*fp32")
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in AOT_DIVISIBLE}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def aot(a: argparse.Namespace) -> int:
    """Each config's GEMM kernel (and stream-K's fixup) compiled for sm_90a, ptxas -v."""
    import subprocess
    import tempfile

    import triton

    from zerod.engine.kernels import skinny_gemm as sg

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    rows = []
    for dtype in a.dtypes:
        configs = sg.CONFIGS["fp8" if dtype == "fp8" else "half"][:a.max_configs or None]
        for cfg in configs:
            tiles = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HAS_BIAS=False, SWAP_AB=cfg.swap_ab)
            consts = dict(tiles, BLOCK_K=cfg.BLOCK_K, EVEN_K=True, SCALED=dtype == "fp8",
                          PROMOTE=dtype == "fp8" and not cfg.fast_accum)
            row = {"dtype": dtype, "name": cfg.name, "config": cfg.as_dict()}
            try:
                k = aot_compile(sg._stream_k_kernel if cfg.stream_k else sg._skinny_kernel, dtype, consts,
                                {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                                partial=cfg.SPLIT_K > 1)
                if cfg.stream_k:   # its fixup: compiled too, so an error shows here, not on the device
                    aot_compile(sg._stream_k_fixup_kernel, dtype, tiles, {"num_warps": 8})
                ptx = k.asm["ptx"]
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(ptx)
                p = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                   capture_output=True, text=True)
                os.unlink(f.name)
                log = p.stderr
                row.update(smem=k.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                           mma_sync=ptx.count("mma.sync"), ptxas_rc=p.returncode,
                           registers=int(_grab(log, r"Used (\d+) registers") or -1),
                           spill_bytes=int(_grab(log, r"(\d+) bytes spill stores") or 0),
                           warnings=[ln.split(" : ", 1)[-1].strip()[:160] for ln in log.splitlines()
                                     if "warning" in ln or "Performance" in ln])   # e.g. serialised wgmma
            except Exception as e:   # a compiler error: the config cannot run anywhere
                row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rows.append(row)
            print(aot_line(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"aot": "sm_90a", "rows": rows}, indent=1))
    bad = [r for r in rows if "error" in r or r.get("ptxas_rc") or r.get("spill_bytes")]
    print(f"{len(rows)} configs compiled for sm_90a, {len(bad)} with an error or spills; {a.out}")
    return 1 if any("error" in r or r.get("ptxas_rc") for r in rows) else 0


def _grab(text: str, pattern: str) -> str | None:
    import re

    m = re.search(pattern, text)
    return m.group(1) if m else None


def aot_line(r: dict) -> str:
    if "error" in r:
        return f"{r['dtype']:4} {r['name']:32} ERROR {r['error']}"
    mma = f"wgmma x{r['wgmma']}" if r["wgmma"] else f"mma.sync x{r['mma_sync']}"
    warn = f"  ptxas: {'; '.join(r['warnings'])}" if r["warnings"] else ""
    return (f"{r['dtype']:4} {r['name']:32} smem {r['smem'] // 1024:4d} KB  {r['registers']:3d} regs  "
            f"spills {r['spill_bytes']:3d} B  {mma}{warn}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return aot(a) if a.aot else run(a)


if __name__ == "__main__":
    sys.exit(main())
