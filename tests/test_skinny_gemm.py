"""The skinny GEMM candidates (engine/kernels/skinny_gemm.py) against float32 references,
and the pure-Python parts of their device sweep (gpu/skinny_gemm_bench.py).

On the CPU through Triton's interpreter (one subprocess: the interpreter must be on
before the kernels are defined, tests/kernel_checks.py), every config of CONFIGS at small
shapes whose M, N and K are not multiples of the tiles; fp16 operands there, since the
interpreter's tl.dot on bf16 is wrong (tests/test_kernels_interpreter.py). Every output
starts as NaN, so an element a kernel skips fails the check. Tolerances: the output's
rounding (fp16 ~5e-4 relative, bf16 ~4e-3 as the interpreter truncates), float32
outputs of FP8 products to 1e-5 (exact products, float32 sums in another order); on the
GPU 1e-3 for those (Hopper's FP8 tensor cores keep ~14 bits of the running sum within a
K step; the "fast" configs never promote it). On the
GPU (@gpu): bf16 and the 8B shapes against F.linear and torch._scaled_mm, replay from a
CUDA graph, and the same bits on every run (split-K and stream-K included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_scripts
from kernel_checks import report, run_in_interpreter

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# small shapes: M below, at and past a 16/32-token tile; N past a 64-column tile; K = 320
# leaves a K tail for every BLOCK_K above 64, K = 128 none up to 128 (EVEN_K)
SHAPES = [(1, 64, 128), (5, 96, 320), (16, 64, 320), (33, 96, 128)]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp(min=1e-12))


def run_checks(device: torch.device) -> list[tuple[str, float, float]]:
    """(case, relative error, tolerance) for both wrappers on device."""
    from zerod.engine.kernels import skinny_gemm as sg
    from zerod.engine.quant import fp8

    gpu = device.type == "cuda"
    half = torch.bfloat16 if gpu else torch.float16
    tol = {**TOL, **({torch.bfloat16: 5e-3, torch.float32: 1e-3} if gpu else {})}
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    nan = lambda M, N, dt: torch.full((M, N), float("nan"), dtype=dt, device=device)  # noqa: E731
    res = []

    def half_case(name, x, w, cfg, out=None):
        y = sg.skinny_matmul(x, w, cfg=cfg, out=nan(x.shape[0], w.shape[0], x.dtype) if out is None else out)
        res.append((name, _rel(y.float(), x.float() @ w.float().T), tol[x.dtype]))

    def fp8_case(name, M, N, K, cfg, out_dtype=half, bias=False, scale="column", w_view=False):
        x, w = rnd(M, K), rnd(N + 16 if w_view else N, K) * 0.05
        xq, xs = fp8.quantize_rows(x)
        wq, ws = fp8.quantize_rows(w)
        if w_view:   # the rows of one part of a fused weight
            wq, ws = wq[16:], ws[16:]
        if scale == "static":   # one scale for every token, broadcast (stride 0)
            xs = torch.full((1, 1), 0.01, device=device)
            xq = fp8.quantize(x, xs)
            xs_arg = xs.expand(M, 1)
        else:
            xs_arg = xs[:, None] if scale == "column" else xs
        b = rnd(N).to(half) if bias else None
        y = sg.skinny_matmul_fp8(xq, xs_arg, wq, ws, bias=b, out_dtype=out_dtype, cfg=cfg,
                                 out=nan(M, N, out_dtype))
        ref = (xq.float() * xs_arg.float().reshape(M, 1)) @ (wq.float() * ws[:, None]).T + (b.float() if bias else 0.0)
        res.append((name, _rel(y.float(), ref), tol[out_dtype]))

    for cfg in sg.CONFIGS["half"]:
        for M, N, K in SHAPES:
            half_case(f"half {cfg.name} M={M} N={N} K={K}", rnd(M, K).to(half), (rnd(N, K) * 0.05).to(half), cfg)
    for cfg in sg.CONFIGS["fp8"]:
        for M, N, K in SHAPES:
            fp8_case(f"fp8 {cfg.name} M={M} N={N} K={K}", M, N, K, cfg)
    # the heuristic's picks (swap-AB and not, split-K at a narrow N and long K)
    for M, N, K in [(1, 64, 2048), (20, 96, 320), (64, 64, 128), (100, 96, 320), (200, 64, 256)]:
        for dt in (half, sg.FP8):
            cfg = sg.default_config(M, N, K, dt)
            if dt == sg.FP8:
                fp8_case(f"fp8 default {cfg.name} M={M} N={N} K={K}", M, N, K, None)
            else:
                half_case(f"half default {cfg.name} M={M} N={N} K={K}", rnd(M, K).to(half),
                          (rnd(N, K) * 0.05).to(half), None)
    # stream-K with more (tile, K step) iterations than the 132 programs: 140 tiles of two
    # steps in runs of three (a whole tile, then the first half of the next; its second half,
    # then a whole one); a K tail (768 over 512-wide steps) in runs of one whole tile; two
    # row tiles (no swap, 200 tokens); runs of two over tiles of three steps, with a bias
    for kind, M, N, K, cfg in [
            ("half", 1, 8960, 512, sg.SkinnyConfig(16, 64, 256, 1, 4, 4, True, True)),
            ("fp8", 5, 4480, 768, sg.SkinnyConfig(16, 64, 512, 1, 4, 4, True, True)),
            ("half", 200, 1024, 320, sg.SkinnyConfig(128, 128, 64, 1, 8, 4, False, True)),
            ("fp8", 40, 3072, 384, sg.SkinnyConfig(64, 64, 128, 1, 4, 4, True, True))]:
        if kind == "half":
            half_case(f"half stream-K {cfg.name} M={M} N={N} K={K}", rnd(M, K).to(half),
                      (rnd(N, K) * 0.05).to(half), cfg)
        else:
            fp8_case(f"fp8 stream-K {cfg.name} M={M} N={N} K={K} bias", M, N, K, cfg, bias=True)
    # strided operands: x rows and w rows spaced wider than K, out into a wider buffer
    split = sg.SkinnyConfig(16, 64, 128, 2, 4, 2, True)
    for cfg in (split, sg.SkinnyConfig(16, 64, 128, 1, 4, 2, False), sg.SkinnyConfig(16, 64, 128, stream_k=True)):
        x = rnd(5, 400).to(half)[:, 16:336]
        w = (rnd(96, 352) * 0.05).to(half)[:, :320]
        buf = nan(5, 130, half)
        half_case(f"half strided x, w and out {cfg.name}", x, w, cfg, out=buf[:, 7:103])
        rest = torch.cat([buf[:, :7], buf[:, 103:]], 1)
        res.append((f"half out's other columns untouched {cfg.name}",
                    0.0 if torch.isnan(rest).all() else float("inf"), 0.0))
    # FP8 variants: bias, scale layouts, the output dtypes, a weight view (fused rows)
    for cfg in (split, sg.SkinnyConfig(16, 64, 256, 1, 4, 2, False)):
        fp8_case(f"fp8 bias {cfg.name}", 5, 96, 320, cfg, bias=True)
        fp8_case(f"fp8 x_scale [M] {cfg.name}", 5, 96, 320, cfg, scale="flat")
        fp8_case(f"fp8 static x_scale {cfg.name}", 5, 96, 320, cfg, scale="static")
        fp8_case(f"fp8 out float32 {cfg.name}", 33, 96, 320, cfg, out_dtype=torch.float32, bias=True)
        fp8_case(f"fp8 out bf16 {cfg.name}", 5, 64, 320, cfg, out_dtype=torch.bfloat16)
        fp8_case(f"fp8 weight rows of a fused weight {cfg.name}", 5, 96, 320, cfg, w_view=True)
    # empty batch: nothing launched, the shape kept
    e = sg.skinny_matmul(rnd(0, 64).to(half), rnd(32, 64).to(half))
    res.append(("half M=0 gives [0, N]", 0.0 if e.shape == (0, 32) else float("inf"), 0.0))
    return res


SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter, report
patch_triton_interpreter()
from test_skinny_gemm import run_checks
res = run_checks(torch.device("cpu"))
print(report(res))
print("cases", len(res))
print("RESULT", "ok" if res and all(e <= t for _, e, t in res) else "bad")
"""


@pytest.mark.slow   # seconds: Triton's interpreter or compiler (tests/conftest.py's SLOW_MODULES kind)
def test_skinny_gemm_in_interpreter():
    run_in_interpreter(SCRIPT)


# --------------------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def sg():
    from zerod.engine.kernels import skinny_gemm
    return skinny_gemm


def test_bad_inputs_are_refused(sg):
    h = torch.float16
    x, w = torch.randn(4, 64, dtype=h), torch.randn(32, 64, dtype=h)
    bad = [
        (lambda: sg.skinny_matmul(x, torch.randn(32, 48, dtype=h)), "disagree on K"),
        (lambda: sg.skinny_matmul(x[0], w), r"x must be \[M, K\]"),
        (lambda: sg.skinny_matmul(x.float(), w.float()), "bf16 / fp16"),
        (lambda: sg.skinny_matmul(x, w.bfloat16()), "bf16 / fp16"),
        (lambda: sg.skinny_matmul(x, torch.randn(64, 32, dtype=h).t()), "contiguous along K"),
        (lambda: sg.skinny_matmul(x, w, out=torch.empty(4, 31, dtype=h)), "out must be"),
        (lambda: sg.skinny_matmul(x, w, out=torch.empty(4, 32, dtype=torch.float32)), "out must be"),
        (lambda: sg.skinny_matmul(x, w, out=torch.empty(32, 4, dtype=h).t()), "unit column stride"),
    ]
    xq, wq = x.to(sg.FP8), w.to(sg.FP8)
    xs, ws = torch.ones(4, 1), torch.ones(32)
    bad += [
        (lambda: sg.skinny_matmul_fp8(x, xs, wq, ws, out_dtype=h), "float8_e4m3fn"),
        (lambda: sg.skinny_matmul_fp8(xq, torch.ones(3, 1), wq, ws, out_dtype=h), "x_scale must hold 4"),
        (lambda: sg.skinny_matmul_fp8(xq, xs, wq, torch.ones(32, dtype=h), out_dtype=h), "w_scale must hold 32"),
        (lambda: sg.skinny_matmul_fp8(xq, xs, wq, ws, out_dtype=torch.int8), "out_dtype"),
        (lambda: sg.skinny_matmul_fp8(xq, xs, wq, ws, bias=torch.ones(31), out_dtype=h), "bias must hold 32"),
        (lambda: sg.skinny_matmul_fp8(xq, xs, wq[:, :48], ws, out_dtype=h), "disagree on K"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()


def test_configs_are_valid_and_round_trip(sg):
    for kind, configs in sg.CONFIGS.items():
        assert 8 <= len(configs) <= 20 and len(set(configs)) == len(configs), kind
        assert {c.swap_ab for c in configs} == {True, False} and {c.SPLIT_K for c in configs} >= {1, 2, 4}
        assert {c.stream_k for c in configs} == {True, False}
        for c in configs:
            assert sg.SkinnyConfig.from_dict(json.loads(json.dumps(c.as_dict()))) == c
            bk_bytes = 1 if kind == "fp8" else 2
            smem = (c.BLOCK_M + c.BLOCK_N) * c.BLOCK_K * bk_bytes * c.num_stages
            assert smem <= 160 * 1024, (c.name, smem)   # room in the H200's 227 KB a block
    for bad in (dict(BLOCK_M=8), dict(BLOCK_N=96), dict(SPLIT_K=0), dict(num_warps=3),
                dict(SPLIT_K=2, stream_k=True)):
        with pytest.raises(ValueError):
            sg.SkinnyConfig(**bad)


def test_default_config_follows_the_shape(sg):
    small = sg.default_config(1, 6144, 4096, torch.bfloat16)
    assert small.swap_ab and small.BLOCK_M == 16 and small.SPLIT_K == 1   # 96 programs: enough
    assert sg.default_config(1, 4096, 4096, torch.bfloat16).SPLIT_K == 2   # 64 programs: split
    assert sg.default_config(33, 4096, 4096, torch.bfloat16).BLOCK_M == 64
    big = sg.default_config(200, 28672, 4096, torch.bfloat16)
    assert not big.swap_ab and big.BLOCK_M == 128 and big.SPLIT_K == 1
    assert sg.default_config(16, 4096, 4096, sg.FP8).BLOCK_K == 2 * small.BLOCK_K
    # a short K is never split below four K steps a slice
    assert sg.default_config(1, 64, 512, torch.bfloat16).SPLIT_K == 1
    # at the 8B shapes the defaults take CONFIGS' tiles (the split apart)
    tiles = lambda c: dataclasses.replace(c, SPLIT_K=1)  # noqa: E731
    for dt in (torch.bfloat16, sg.FP8):
        swept = {tiles(c) for c in sg.configs_for(dt)}
        for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
            for M in (1, 8, 16, 17, 32, 48, 64, 65, 128, 200, 256, 512):
                assert tiles(sg.default_config(M, N, K, dt)) in swept, (M, N, K, dt)


def test_launches_at_the_8b_shapes_fit_cuda_limits(sg, monkeypatch):
    """The host side of every config at every shape and M the sweep runs, on meta tensors
    (no kernel runs): grids within CUDA's limits, whole K steps (no masked loads), stream-K
    at most one program per SM and a split-K sum launched exactly when K is split."""
    launches = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, kw))

    for name in ("_skinny_kernel", "_sum_splits_kernel", "_stream_k_kernel", "_stream_k_fixup_kernel"):
        monkeypatch.setattr(sg, name, Kernel(name))
    e = lambda *shape, dt=torch.float32: torch.empty(*shape, dtype=dt, device="meta")  # noqa: E731
    for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        for M in (1, 16, 64, 128, 200, 256):
            for kind in ("half", "fp8"):
                for cfg in sg.CONFIGS[kind]:
                    launches.clear()
                    if kind == "half":
                        sg.skinny_matmul(e(M, K, dt=torch.bfloat16), e(N, K, dt=torch.bfloat16), cfg=cfg)
                    else:
                        sg.skinny_matmul_fp8(e(M, K, dt=sg.FP8), e(M, 1), e(N, K, dt=sg.FP8), e(N),
                                             out_dtype=torch.bfloat16, cfg=cfg)
                    (name, grid, kw), *rest = launches
                    where = (N, K, M, cfg.name)
                    assert kw["EVEN_K"] and grid[0] < 2 ** 31 and all(g <= 65535 for g in grid[1:]), where
                    if cfg.stream_k:
                        assert name == "_stream_k_kernel" and grid[0] <= sg.SMS, where
                        assert [r[0] for r in rest] == ["_stream_k_fixup_kernel"] and rest[0][1] == (grid[0] - 1,)
                    else:
                        assert name == "_skinny_kernel" and grid[2] == min(cfg.SPLIT_K, K // cfg.BLOCK_K), where
                        assert [r[0] for r in rest] == (["_sum_splits_kernel"] if grid[2] > 1 else []), where


# --------------------------------------------------------------------------- the sweep script

@pytest.fixture(scope="module")
def bench():
    return gpu_scripts.load("skinny_gemm_bench")


def test_bench_roofline(bench):
    # o at M = 200, bf16: weights 4096·4096·2 B, x 200·4096·2, y 200·4096·2, over 4.245 TB/s;
    # FLOPs 2·200·4096² over 808.4 TFLOP/s: 8.68 us of bytes against 8.30 us of math
    b = bench.bound_us("bf16", 200, 4096, 4096)
    by = (4096 * 4096 * 2 + 2 * 200 * 4096 * 2) / 4.245e12
    fl = 2 * 200 * 4096 * 4096 / 808.4e12
    assert b == pytest.approx(1e6 * by) and by > fl
    # FP8: one byte a weight and an activation, the scales, a bf16 output; memory-bound at M = 1
    f = bench.bound_us("fp8", 1, 28672, 4096)
    assert f == pytest.approx(1e6 * (28672 * 4096 + 4096 + 28672 * 2 + 4 * (1 + 28672)) / 4.245e12)


def test_bench_args_and_subsets(bench):
    a = bench.parse_args(["--quick", "--out", "/tmp/x/skinny.json"])
    assert len(a.shapes) == 2 and a.table_out == "/tmp/x/skinny_table.json" and a.dtypes == ["bf16", "fp8"]
    full = bench.parse_args(["--out", "o.json", "--ms", "1,200", "--shapes", "o,lm_head"])
    assert full.ms == [1, 200] and full.shapes == ["o", "lm_head"]
    assert set(bench.parse_args(["--out", "o.json"]).shapes) == {"qkv", "o", "gate_up", "down", "lm_head"}
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o.json", "--shapes", "nope"])


def test_bench_measures_the_priority_batch_first(bench):
    order = bench.cells(["o", "lm_head"], ["bf16", "fp8"], [1, 16, 200, 256])
    assert [m for m, _, _ in order] == [200, 200, 200, 256, 256, 256, 16, 16, 16, 1, 1, 1]
    assert ("fp8" not in {d for _, s, d in order if s == "lm_head"}) and len(set(order)) == len(order)


def test_bench_graph_timing_arithmetic(bench):
    """graph_time_us's control flow on a stand-in for torch.cuda whose events report a fixed
    0.05 ms a round (a fixture, not a measurement): 20 rounds captured, per-call time out."""
    import contextlib
    import types

    calls = []
    captured = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.05 * graphs[-1].rounds

    class CUDAGraph:
        rounds = 0

        def replay(self):
            pass

    graphs = []

    @contextlib.contextmanager
    def graph(g):
        graphs.append(g)
        n = len(calls)
        yield
        g.rounds = (len(calls) - n) // 4
        captured.append(g.rounds)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        synchronize=lambda: None, Event=Event, CUDAGraph=CUDAGraph, graph=graph))
    fns = [lambda: calls.append(1)] * 4
    us = bench.graph_time_us(fake, fns)
    assert captured == [1, 20] and us == pytest.approx(0.05 * 1e3 / 4)


def test_bench_best_skips_wrong_results(bench):
    # fixture rows (not measurements): the fastest Triton row is wrong and must not win
    rows = [
        {"dtype": "bf16", "shape": "o", "N": 4096, "K": 4096, "M": 16, "impl": "cublas", "name": "cuBLAS",
         "config": None, "us": 10.0, "ok": True, "bound_us": 8.0},
        {"dtype": "bf16", "shape": "o", "N": 4096, "K": 4096, "M": 16, "impl": "triton", "name": "fast but wrong",
         "config": {"x": 1}, "us": 5.0, "ok": False, "bound_us": 8.0},
        {"dtype": "bf16", "shape": "o", "N": 4096, "K": 4096, "M": 16, "impl": "triton", "name": "right",
         "config": {"x": 2}, "us": 9.0, "ok": True, "bound_us": 8.0},
        {"dtype": "bf16", "shape": "o", "N": 4096, "K": 4096, "M": 16, "impl": "triton", "name": "failed",
         "config": {"x": 3}, "error": "OutOfResources", "ok": False, "bound_us": 8.0},
    ]
    best = bench.best_per_cell(rows)
    cell = best["bf16"]["4096x4096"]["16"]
    assert cell["name"] == "right" and cell["config"] == {"x": 2} and cell["speedup"] == pytest.approx(10 / 9)
    lines = bench.table_lines(rows, best)
    assert any("right" in line and "1.11x" in line for line in lines), lines


@pytest.mark.slow   # seconds: Triton's interpreter or compiler (tests/conftest.py's SLOW_MODULES kind)
def test_bench_dry_run_through_the_interpreter(tmp_path):
    """The whole script on tiny shapes through Triton's interpreter: its control flow,
    checks and JSON files (its times are the interpreter's wall-clock, not a GPU's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out, table = tmp_path / "skinny.json", tmp_path / "table.json"
    p = subprocess.run([sys.executable, "gpu/skinny_gemm_bench.py", "--interpret", "--out", str(out),
                        "--table-out", str(table), "--max-configs", "3", "--ms", "5,33"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["info"]["interpret"] and not d["stopped_early"]
    triton_rows = [r for r in d["rows"] if r["impl"] == "triton"]
    cublas_rows = [r for r in d["rows"] if r["impl"] == "cublas"]
    assert triton_rows and cublas_rows and all(r["ok"] for r in d["rows"]), [r for r in d["rows"] if not r["ok"]]
    assert {r["dtype"] for r in d["rows"]} == {"bf16", "fp8"}
    assert len(triton_rows) == 3 * len(cublas_rows)
    t = json.loads(table.read_text())
    assert set(t["best"]) == {"bf16", "fp8"}
    cells = 0
    for per_shape in t["best"].values():
        for per_m in per_shape.values():
            for cell in per_m.values():
                assert cell["config"] and cell["triton_us"] > 0 and cell["cublas_us"] > 0
                cells += 1
    assert cells == len(cublas_rows)
    assert "speedup" in p.stdout
    # what an engine start reads back (engine/kernels/gemm_table.py): at min_speedup 0
    # every row count up to the largest measured one takes a typed config
    from zerod.engine.kernels.gemm_table import expand
    from zerod.engine.kernels.skinny_gemm import SkinnyConfig
    picked = expand(t, min_speedup=0.0)
    assert all(isinstance(c, SkinnyConfig) for c in picked.values())
    measured = {(r["dtype"], r["N"], r["K"]): max(x["M"] for x in cublas_rows if x["N"] == r["N"]
                                                   and x["dtype"] == r["dtype"]) for r in cublas_rows}
    assert len(picked) == sum(measured.values())
    assert len(expand(t, min_speedup=float("inf"))) == 0


@pytest.mark.slow   # seconds: Triton's interpreter or compiler (tests/conftest.py's SLOW_MODULES kind)
def test_every_config_compiles_for_sm90a(tmp_path):
    """Each config compiled ahead for the H200 (sm_90a) on the CPU, as the JIT compiles it
    at the 8B shapes: no compiler error, no register spills, no serialised wgmma, shared
    memory within a block's 227 KB, and wgmma wherever the MMA's M side has 64 rows."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("this Triton has no bundled ptxas")
    out = tmp_path / "aot.json"
    p = subprocess.run([sys.executable, "gpu/skinny_gemm_bench.py", "--aot", "--out", str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    from zerod.engine.kernels.skinny_gemm import CONFIGS
    assert len(rows) == sum(len(c) for c in CONFIGS.values())
    for r in rows:
        c = r["config"]
        assert "error" not in r and r["spill_bytes"] == 0 and not r["warnings"], r
        assert r["smem"] <= 227 * 1024, r
        mma_rows = c["BLOCK_N"] if c["swap_ab"] else c["BLOCK_M"]
        assert (r["wgmma"] > 0) == (mma_rows >= 64), r


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_skinny_gemm_on_gpu():
    res = run_checks(torch.device("cuda"))
    assert all(e <= t for _, e, t in res), report(res)


@pytest.mark.gpu
def test_skinny_gemm_against_cublas_at_8b_shapes():
    """bf16 against F.linear and FP8 against torch._scaled_mm (row-wise, as Fp8Linear.w8a8
    calls it) at two 8B projections; every config; the same bits on every run; a CUDA
    graph's replay on new activations."""
    import torch.nn.functional as F

    from zerod.engine.kernels import skinny_gemm as sg
    from zerod.engine.quant import fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    bad = []
    for N, K in [(6144, 4096), (4096, 14336)]:
        w = (torch.randn(N, K, generator=g, device=dev) / K ** 0.5).to(torch.bfloat16)
        wq, ws = fp8.quantize_rows(w)
        for M in (1, 16, 200):
            x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
            xq, xs = fp8.quantize_rows(x)
            base = F.linear(x, w)
            base8 = torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws.view(1, -1),
                                     out_dtype=torch.bfloat16)
            for cfg in (None, *sg.CONFIGS["half"]):
                y = sg.skinny_matmul(x, w, cfg=cfg)
                if _rel(y.float(), base.float()) > 1e-2 or not torch.equal(y, sg.skinny_matmul(x, w, cfg=cfg)):
                    bad.append(("bf16", N, K, M, cfg))
            for cfg in (None, *sg.CONFIGS["fp8"]):
                y = sg.skinny_matmul_fp8(xq, xs[:, None], wq, ws, out_dtype=torch.bfloat16, cfg=cfg)
                again = sg.skinny_matmul_fp8(xq, xs[:, None], wq, ws, out_dtype=torch.bfloat16, cfg=cfg)
                # unpromoted FP8 sums (fast_accum) lose bits over K = 14336: right, not exact
                tol = 5e-2 if cfg is not None and cfg.fast_accum else 2e-2
                if _rel(y.float(), base8.float()) > tol or not torch.equal(y, again):
                    bad.append(("fp8", N, K, M, cfg))
    assert not bad, bad
    # captured once with a split-K and a stream-K config (their workspaces from the graph's
    # pool), replayed on new activations
    w = (torch.randn(4096, 4096, generator=g, device=dev) / 64).to(torch.bfloat16)
    x = torch.randn(8, 4096, generator=g, device=dev).to(torch.bfloat16)
    for cfg in (sg.SkinnyConfig(16, 64, 256, 2, 4, 4, True), sg.SkinnyConfig(16, 64, 256, stream_k=True)):
        sg.skinny_matmul(x, w, cfg=cfg)   # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = sg.skinny_matmul(x, w, cfg=cfg)
        x.copy_(torch.randn(8, 4096, generator=g, device=dev))
        graph.replay()
        assert _rel(y.float(), x.float() @ w.float().T) < 5e-3, cfg
