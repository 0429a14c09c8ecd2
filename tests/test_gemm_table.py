"""The skinny GEMM table (engine/kernels/gemm_table.py): which products take a Triton tile
the device measured faster than cuBLAS, and that the projections follow it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from zerod.engine.kernels import gemm_table
from zerod.engine.kernels.skinny_gemm import SkinnyConfig
from zerod.engine.model.linear import Linear

FAST = SkinnyConfig(16, 64, 256, 1, 4, 4, True)
WIDE = SkinnyConfig(256, 64, 64, 2, 8, 4, True)


def table(cells: dict) -> dict:
    """The bench's --table-out shape: {"best": {dtype: {"NxK": {"M": cell}}}}."""
    best: dict = {}
    for (dtype, n, k, m), (cfg, speedup) in cells.items():
        best.setdefault(dtype, {}).setdefault(f"{n}x{k}", {})[str(m)] = {
            "config": cfg.as_dict(), "speedup": speedup, "triton_us": 1.0, "cublas_us": speedup}
    return {"info": {}, "best": best}


@pytest.fixture(autouse=True)
def clean():
    yield
    gemm_table.cells.clear()


def test_each_row_count_takes_the_measured_cell_at_or_above_it():
    t = table({("bf16", 64, 32, 16): (FAST, 1.4), ("bf16", 64, 32, 64): (FAST, 0.9),
               ("bf16", 64, 32, 200): (WIDE, 1.2), ("fp8", 64, 32, 1): (FAST, 1.5)})
    cells = gemm_table.expand(t)
    bf16 = {m: c for (d, n, k, m), c in cells.items() if d == torch.bfloat16}
    assert set(bf16) == set(range(1, 17)) | set(range(65, 201))   # 17..64: cuBLAS won at 64
    assert bf16[16] == FAST and bf16[65] == WIDE and bf16[200] == WIDE
    assert cells[torch.float8_e4m3fn, 64, 32, 1] == FAST and (torch.float8_e4m3fn, 64, 32, 2) not in cells
    gemm_table.cells.update(cells)   # the warm-up runs the top of each range a config serves
    assert gemm_table.row_counts() == {1, 16, 200}
    # a cell a few per cent faster is within the timings' noise: cuBLAS keeps it
    assert gemm_table.expand(table({("bf16", 64, 32, 8): (FAST, 1.08)})) == {}


def test_no_table_on_the_cpu_or_when_tuned_off(tmp_path):
    assert gemm_table.activate(torch.device("cpu")) == 0
    assert gemm_table.choice(torch.bfloat16, 64, 32, 8) is None
    assert gemm_table.activate(torch.device("cuda"), enabled=False, folder=tmp_path) == 0


def test_an_unreadable_table_leaves_cublas_serving(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU 9")
    (tmp_path / "Test_GPU_9.json").write_text('{"best": {"bf16": {"64x32": {"8": {"config": {"BLOCK_M": 3}, "speedup": 2.0}}}}}')
    with caplog.at_level("WARNING", logger="zerod.engine"):
        assert gemm_table.activate(torch.device("cuda"), folder=tmp_path) == 0
    assert "unreadable" in caplog.text and gemm_table.choice(torch.bfloat16, 64, 32, 8) is None
    (tmp_path / "Test_GPU_9.json").write_text(json.dumps(table({("bf16", 64, 32, 8): (FAST, 2.0)})))
    assert gemm_table.activate(torch.device("cuda"), folder=tmp_path) == 8
    assert gemm_table.choice(torch.bfloat16, 64, 32, 5) == FAST
    assert gemm_table.choice(torch.bfloat16, 64, 32, 9) is None


def test_a_projection_takes_the_tables_kernel_for_its_shape_only(monkeypatch):
    """The listed (dtype, N, K, M) goes to the skinny kernel, anything else (another M, a
    bias, another shape) to F.linear. The kernel is a stand-in here: the CPU runs no Triton
    outside the interpreter (the GPU test below runs the real one)."""
    calls = []

    class Kernels:
        @staticmethod
        def skinny_matmul(x, w, cfg):
            calls.append((tuple(x.shape), cfg))
            return F.linear(x, w)

    gemm_table.cells[torch.float32, 64, 32, 4] = FAST
    monkeypatch.setattr(gemm_table, "_module", Kernels)
    lin = Linear(64, 32, bias=False, dtype=torch.float32, device="cpu")
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(4, 32)
    assert torch.equal(lin(x), F.linear(x, lin.weight)) and calls == [((4, 32), FAST)]
    lin(torch.randn(5, 32))
    Linear(64, 32, bias=True, dtype=torch.float32, device="cpu")(x)
    assert len(calls) == 1


@pytest.mark.gpu
def test_the_listed_products_match_cublas_on_a_gpu(tmp_path, monkeypatch):
    """A table naming a bf16 projection at three row counts: the Linear's product, through
    the Triton kernel, agrees with F.linear's."""
    dev = torch.device("cuda")
    cells = {("bf16", 1024, 512, m): (cfg, 2.0) for m, cfg in ((1, FAST), (16, FAST), (200, WIDE))}
    (tmp_path / f"{torch.cuda.get_device_name(dev).replace(' ', '_')}.json").write_text(json.dumps(table(cells)))
    assert gemm_table.activate(dev, folder=tmp_path) == 200
    lin = Linear(1024, 512, bias=False, dtype=torch.bfloat16, device=dev)
    torch.nn.init.normal_(lin.weight, std=512 ** -0.5)
    for m in (1, 7, 16, 100, 200):
        x = torch.randn(m, 512, device=dev, dtype=torch.bfloat16)
        y, ref = lin(x).float(), F.linear(x, lin.weight).float()
        assert (y - ref).norm() <= 1e-2 * ref.norm(), m
