"""The active tests, through torch on the GPU. Each takes the torch module, the
GPU's index, its NVML facts and the level's sizes, and returns a DiagResult;
timings come from CUDA events around repeated runs after a warm-up."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from zerod.checks.gpu_specs import GpuSpec, pcie_gb_s
from zerod.diag import judge, verify
from zerod.diag.nvml_health import HW_SLOWDOWN_REASONS
from zerod.diag.report import DiagResult, Figure

GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int        # HBM copy buffer
    copy_iters: int
    gemm_n: int            # M = N = K
    gemm_iters: int
    host_bytes: int        # pinned host buffer for PCIe copies
    host_iters: int
    peer_bytes: int
    peer_iters: int
    pattern_fraction: float = 0.0  # diag.memory_pattern: share of free memory written (full only)
    stress_s: float = 0.0          # diag.gemm_stress: seconds of GEMMs (full only)


SIZES = {
    "quick": Sizes(GIB, 10, 8192, 20, 256 << 20, 5, 256 << 20, 5),
    "full": Sizes(4 * GIB, 20, 8192, 100, GIB, 10, GIB, 10, pattern_fraction=0.8, stress_s=30.0),
}


def _timed(torch, dev: int, fn, iters: int, warmup: int = 2) -> float:
    """Seconds per call of fn() on device `dev`, by CUDA events."""
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / iters


def cuda_context(torch, gpu: int) -> DiagResult:
    t0 = time.perf_counter()
    n = 1 << 20
    x = torch.arange(n, device=f"cuda:{gpu}", dtype=torch.int64)
    total = int((x * 2).sum().item())  # integers: exact, so any other answer is wrong
    want = n * (n - 1)  # 2 * sum(0..n-1)
    ms = (time.perf_counter() - t0) * 1000
    props = torch.cuda.get_device_properties(gpu)
    ev = [{"name": "device", "value": props.name, "source": "torch.cuda.get_device_properties"},
          {"name": "kernel_result", "value": total, "source": f"sum(2*arange(2^20)), expected {want}"}]
    if total != want:
        return DiagResult("diag.cuda_context", "fail", gpu, message=f"a kernel returned {total}, not {want}",
                          evidence=ev)
    return DiagResult("diag.cuda_context", "pass", gpu, message=f"context created, kernel ran in {ms:.0f} ms",
                      evidence=ev)


def hbm_bandwidth(torch, gpu: int, spec: GpuSpec | None, sizes: Sizes) -> DiagResult:
    n = sizes.copy_bytes // 4
    src = torch.empty(n, dtype=torch.int32, device=f"cuda:{gpu}")
    dst = torch.empty_like(src)
    verify.fill_pattern(torch, src, seed=gpu + 1)
    s = _timed(torch, gpu, lambda: dst.copy_(src), sizes.copy_iters)
    gb_s = 2 * sizes.copy_bytes / s / 1e9  # each byte read once and written once
    bad = verify.pattern_mismatches(torch, dst, seed=gpu + 1)
    expected = spec.hbm_gb_s if spec else None
    ev = [{"name": "copy_bytes", "value": sizes.copy_bytes, "source": "device-to-device copy, read + write counted"},
          {"name": "mismatched_words", "value": bad, "source": "the copy against its pattern, regenerated"}]
    status = "fail" if bad else judge.verdict(gb_s, expected)
    msg = judge.describe("copy", gb_s, expected, "GB/s")
    if bad:
        msg = f"the copy came back wrong: {bad} of {n} words differ; " + msg
    return DiagResult("diag.hbm_bandwidth", status, gpu, message=msg, measured=Figure(gb_s, "GB/s"),
                      expected=Figure(expected, "GB/s") if expected else None, evidence=ev)


def _gemm_verdict(test: str, gpu: int, tflops: float, expected: float | None, residual: float,
                  tile: float, ev: list[dict]) -> DiagResult:
    ev += [{"name": "freivalds_residual", "value": round(residual, 4),
            "source": "C·X against A·(B·X) in fp32, over 8 sigmas of bf16 rounding; > 1 is wrong"},
           {"name": "cpu_tile_error", "value": round(tile, 4),
            "source": "a 64x64 tile against float64 on the CPU, over bf16's rounding bound; > 1 is wrong"}]
    wrong = residual > 1.0 or tile > 1.0
    status = "fail" if wrong else judge.verdict(tflops, expected)
    msg = judge.describe("GEMM", tflops, expected, "TFLOP/s")
    if wrong:
        msg = "the product is wrong (see the residuals); " + msg
    return DiagResult(test, status, gpu, message=msg, measured=Figure(tflops, "TFLOP/s"),
                      expected=Figure(expected, "TFLOP/s") if expected else None, evidence=ev)


def gemm_bf16(torch, gpu: int, spec: GpuSpec | None, sizes: Sizes) -> DiagResult:
    n, dev = sizes.gemm_n, f"cuda:{gpu}"
    g = torch.Generator(device=dev).manual_seed(1234 + gpu)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    with _full_precision_reduction(torch):
        s = _timed(torch, gpu, lambda: torch.matmul(a, b, out=c), sizes.gemm_iters)
    tflops = 2 * n ** 3 / s / 1e12
    residual = verify.gemm_residual(torch, a, b, c)
    tile = verify.gemm_tile_error(torch, a, b, c)
    ev = [{"name": "shape", "value": [n, n, n], "source": "torch.matmul, bf16 in and out"}]
    return _gemm_verdict("diag.gemm_bf16", gpu, tflops, spec.bf16_tflops if spec else None, residual, tile, ev)


@contextlib.contextmanager
def _full_precision_reduction(torch):
    """bf16 GEMMs reduce split-K partial sums in fp32 while measured: the reference's
    tolerance models one rounding of the output, and the figure is the tensor cores', not
    a heuristic's."""
    m = torch.backends.cuda.matmul
    saved = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = saved


def fp8_supported(torch, gpu: int) -> bool:
    return torch.cuda.get_device_capability(gpu) >= (8, 9) and hasattr(torch, "float8_e4m3fn")


def gemm_fp8(torch, gpu: int, spec: GpuSpec | None, sizes: Sizes) -> DiagResult:
    cap = torch.cuda.get_device_capability(gpu)
    if not fp8_supported(torch, gpu) or (spec is not None and spec.fp8_tflops is None):
        return DiagResult("diag.gemm_fp8", "skip", gpu,
                          message=f"no FP8 tensor cores (compute capability {cap[0]}.{cap[1]}; FP8 needs 8.9+)")
    n, dev = sizes.gemm_n, f"cuda:{gpu}"
    g = torch.Generator(device=dev).manual_seed(4321 + gpu)
    a = torch.randn(n, n, device=dev, generator=g).to(torch.float8_e4m3fn)
    bt = torch.randn(n, n, device=dev, generator=g).to(torch.float8_e4m3fn)  # B as N×K rows: column-major B
    one = torch.ones((), device=dev, dtype=torch.float32)
    out: dict[str, Any] = {}

    def run():
        y = torch._scaled_mm(a, bt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        out["c"] = y[0] if isinstance(y, tuple) else y

    s = _timed(torch, gpu, run, sizes.gemm_iters)
    tflops = 2 * n ** 3 / s / 1e12
    c = out["c"]
    residual = verify.gemm_residual(torch, a, bt.t(), c, extra_rel=verify.FP8_ACCUMULATION_REL)
    tile = verify.gemm_tile_error(torch, a, bt.t(), c, extra_rel=verify.FP8_ACCUMULATION_REL)
    ev = [{"name": "shape", "value": [n, n, n], "source": "torch._scaled_mm, e4m3 in, bf16 out, unit scales"}]
    return _gemm_verdict("diag.gemm_fp8", gpu, tflops, spec.fp8_tflops if spec else None, residual, tile, ev)


def _link_rate(nvml_gpu: dict[str, Any]) -> tuple[float | None, dict]:
    """The PCIe link's rate at its best generation and width (an idle link trains down)."""
    gen, width = nvml_gpu.get("pcie_gen_max"), nvml_gpu.get("pcie_width_max")
    link = {k: nvml_gpu.get(k) for k in ("pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max")}
    return pcie_gb_s(gen, width), link


def pcie(torch, gpu: int, nvml_gpu: dict[str, Any], sizes: Sizes, direction: str) -> DiagResult:
    test = "diag.pcie_h2d" if direction == "h2d" else "diag.pcie_d2h"
    n = sizes.host_bytes // 4
    host = torch.empty(n, dtype=torch.int32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.int32, device=f"cuda:{gpu}")
    seed = 7 + gpu
    if direction == "h2d":
        verify.fill_pattern(torch, host, seed)
        s = _timed(torch, gpu, lambda: dev.copy_(host, non_blocking=True), sizes.host_iters)
        bad = verify.pattern_mismatches(torch, dev, seed)
    else:
        verify.fill_pattern(torch, dev, seed)
        s = _timed(torch, gpu, lambda: host.copy_(dev, non_blocking=True), sizes.host_iters)
        bad = verify.pattern_mismatches(torch, host, seed)
    gb_s = sizes.host_bytes / s / 1e9
    expected, link = _link_rate(nvml_gpu)
    ev = [{"name": "pcie_link", "value": link, "source": "nvmlDeviceGet{Curr,Max}PcieLink*"},
          {"name": "copy_bytes", "value": sizes.host_bytes, "source": "pinned host buffer"},
          {"name": "mismatched_words", "value": bad, "source": "the copy against its pattern, regenerated"}]
    status = "fail" if bad else judge.verdict(gb_s, expected)
    msg = judge.describe(direction, gb_s, expected, "GB/s")
    if bad:
        msg = f"the copy came back wrong: {bad} words differ; " + msg
    return DiagResult(test, status, gpu, message=msg, measured=Figure(gb_s, "GB/s"),
                      expected=Figure(expected, "GB/s") if expected else None, evidence=ev)


def p2p(torch, src: int, dst: int, expected: float | None, basis: str, sizes: Sizes) -> DiagResult:
    if not torch.cuda.can_device_access_peer(src, dst):
        return DiagResult("diag.p2p_bandwidth", "skip", src, dst,
                          message=f"no peer access from GPU {src} to GPU {dst} (doctor's gpu.p2p says why)")
    n = sizes.peer_bytes // 4
    a = torch.empty(n, dtype=torch.int32, device=f"cuda:{src}")
    b = torch.empty(n, dtype=torch.int32, device=f"cuda:{dst}")
    seed = 100 + 16 * src + dst
    verify.fill_pattern(torch, a, seed)
    b.copy_(a)  # warm-up: peer mappings are set up on the first copy
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    t0 = time.perf_counter()  # wall clock: the copy involves both devices' streams
    for _ in range(sizes.peer_iters):
        b.copy_(a, non_blocking=True)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    gb_s = sizes.peer_bytes * sizes.peer_iters / (time.perf_counter() - t0) / 1e9
    bad = verify.pattern_mismatches(torch, b, seed)
    ev = [{"name": "expected_basis", "value": basis, "source": "NVML NVLink state / PCIe link"},
          {"name": "mismatched_words", "value": bad, "source": "the copy against its pattern, regenerated"}]
    status = "fail" if bad else judge.verdict(gb_s, expected)
    msg = judge.describe(f"GPU {src} -> GPU {dst}", gb_s, expected, "GB/s")
    if bad:
        msg = f"the copy came back wrong: {bad} words differ; " + msg
    return DiagResult("diag.p2p_bandwidth", status, src, dst, message=msg, measured=Figure(gb_s, "GB/s"),
                      expected=Figure(expected, "GB/s") if expected else None, evidence=ev)


def memory_pattern(torch, gpu: int, sizes: Sizes) -> DiagResult:
    free, total = torch.cuda.mem_get_info(gpu)
    chunk = GIB // 4  # int32 words per 1 GiB chunk
    want = int(free * sizes.pattern_fraction) // GIB
    bufs = []
    try:
        for _ in range(want):
            bufs.append(torch.empty(chunk, dtype=torch.int32, device=f"cuda:{gpu}"))
    except torch.cuda.OutOfMemoryError:
        pass  # what was allocated is tested
    bad = 0
    for seed_shift in (0, 1):  # two passes with different patterns: every bit written both ways in most words
        for i, buf in enumerate(bufs):
            verify.fill_pattern(torch, buf, seed=1000 * seed_shift + i)
        torch.cuda.synchronize(gpu)
        for i, buf in enumerate(bufs):
            bad += verify.pattern_mismatches(torch, buf, seed=1000 * seed_shift + i)
    tested = len(bufs) * GIB
    del bufs
    torch.cuda.empty_cache()
    ev = [{"name": "tested_bytes", "value": tested, "source": f"of {free} free, {total} in all (cudaMemGetInfo)"},
          {"name": "mismatched_words", "value": bad, "source": "two address-derived patterns, written then read"}]
    if not tested:
        return DiagResult("diag.memory_pattern", "error", gpu, message="could not allocate 1 GiB to test", evidence=ev)
    if bad:
        return DiagResult("diag.memory_pattern", "fail", gpu,
                          message=f"{bad} words read back wrong over {tested / GIB:.0f} GiB", evidence=ev)
    return DiagResult("diag.memory_pattern", "pass", gpu,
                      message=f"{tested / GIB:.0f} GiB written and read back twice, no error", evidence=ev,
                      measured=Figure(tested / GIB, "GiB"))


def gemm_stress(torch, gpu: int, spec: GpuSpec | None, sizes: Sizes, clock_events) -> DiagResult:
    """bf16 GEMMs for `stress_s`, each tenth checked, the throughput of the last
    second against the first, NVML's clock event reasons sampled meanwhile."""
    n, dev = sizes.gemm_n, f"cuda:{gpu}"
    g = torch.Generator(device=dev).manual_seed(99 + gpu)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    rates: list[float] = []
    worst = 0.0
    reasons: set[str] = set()
    end = time.monotonic() + sizes.stress_s
    i = 0
    while time.monotonic() < end:
        with _full_precision_reduction(torch):
            s = _timed(torch, gpu, lambda: torch.matmul(a, b, out=c), 10, warmup=0)
        rates.append(2 * n ** 3 / s / 1e12)
        if i % 10 == 0:
            worst = max(worst, verify.gemm_residual(torch, a, b, c, seed=i))
            reasons |= set(clock_events() or [])
        i += 1
    ev = [{"name": "rounds", "value": len(rates), "source": "10 GEMMs a round"},
          {"name": "tflops_first_last", "value": [round(rates[0], 1), round(rates[-1], 1)] if rates else None,
           "source": "CUDA events"},
          {"name": "worst_residual", "value": round(worst, 4), "source": "Freivalds, every tenth round"},
          {"name": "clock_events_seen", "value": sorted(reasons), "source": "NVML, every tenth round"}]
    if not rates:
        return DiagResult("diag.gemm_stress", "error", gpu, message="no round completed", evidence=ev)
    mean = sum(rates) / len(rates)
    if worst > 1.0:
        return DiagResult("diag.gemm_stress", "fail", gpu, evidence=ev, measured=Figure(mean, "TFLOP/s"),
                          message=f"a product under load was wrong (residual {worst:.2f})")
    expected = spec.bf16_tflops if spec else None
    status = judge.verdict(min(rates[-1], mean), expected)
    slow = sorted(reasons & set(HW_SLOWDOWN_REASONS))
    if slow and status == "pass":
        status = "warn"
    msg = judge.describe(f"{sizes.stress_s:.0f} s of GEMMs", mean, expected, "TFLOP/s") + (
        f"; clocks held down meanwhile: {', '.join(slow)}" if slow else "")
    return DiagResult("diag.gemm_stress", status, gpu, message=msg, measured=Figure(mean, "TFLOP/s"),
                      expected=Figure(expected, "TFLOP/s") if expected else None, evidence=ev)
