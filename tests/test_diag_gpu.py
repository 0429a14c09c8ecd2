"""`zerod diag --level quick` on a real GPU: every test runs on GPU 0, the figures
sit near what plain torch measures in the same process, a product made wrong on the
GPU fails the reference, and the run fits its 30-second budget."""

from __future__ import annotations

import time

import pytest

import torch

from zerod.diag import verify
from zerod.diag.runner import run_diag

pytestmark = pytest.mark.gpu  # tests/conftest.py skips them where CUDA is not available


def _plain_torch_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        a @ b
    e.record()
    e.synchronize()
    return 2 * n ** 3 / (s.elapsed_time(e) / 1000 / iters) / 1e12


def test_quick_on_gpu0_against_plain_torch():
    t0 = time.monotonic()
    report = run_diag("quick", [0])
    wall = time.monotonic() - t0
    by_id = {t["id"]: t for t in report["tests"] if t["gpu"] == 0}
    assert by_id["diag.cuda_context"]["status"] == "pass"
    for tid in ("diag.hbm_bandwidth", "diag.gemm_bf16", "diag.pcie_h2d", "diag.pcie_d2h", "diag.health_counters"):
        assert by_id[tid]["status"] in ("pass", "warn"), (tid, by_id[tid]["message"])
    residual = {e["name"]: e["value"] for e in by_id["diag.gemm_bf16"]["evidence"]}
    assert residual["freivalds_residual"] < 1.0 and residual["cpu_tile_error"] < 1.0
    plain = _plain_torch_matmul_tflops()
    assert 0.7 * plain <= by_id["diag.gemm_bf16"]["measured"]["value"] <= 1.3 * plain
    if torch.cuda.get_device_capability(0) >= (8, 9):
        assert by_id["diag.gemm_fp8"]["status"] in ("pass", "warn"), by_id["diag.gemm_fp8"]["message"]
    assert wall <= 30.0, f"quick took {wall:.1f} s on one GPU"


def test_a_product_made_wrong_on_the_gpu_fails_the_reference():
    n = 4096
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    c = a @ b
    assert verify.gemm_residual(torch, a, b, c) < 1.0
    c[1234, 777] = -c[1234, 777] * 4 + 8
    assert verify.gemm_residual(torch, a, b, c) > 1.0
