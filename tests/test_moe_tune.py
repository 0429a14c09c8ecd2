"""The fused MoE kernel's tuned tile tables (engine/kernels/moe.py) and their sweep
(gpu/moe_tune.py), on the CPU.

The loader: a listed shape and token count get the table's config (the smallest measured
T at or above the step's, the largest past them all), anything else `_config`'s defaults;
a bad table is refused by `load_table` with the entry named, and at serving logged and
ignored. Through Triton's interpreter (one subprocess each, tests/kernel_checks.py): the
experts with table configs, split-K included, equal the torch reference, and the sweep's
dry run writes a table the loader accepts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_scripts
from kernel_checks import run_in_interpreter

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
CFG16 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3)
CFG64 = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4, SPLIT_K=2)


@pytest.fixture(scope="module")
def moe():
    from zerod.engine.kernels import moe
    return moe


@pytest.fixture
def table_dir(moe, tmp_path, monkeypatch):
    """The tables' folder as a temporary one, the per-process cache empty."""
    monkeypatch.setattr(moe, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(moe, "_TABLES", {})
    return tmp_path


def doc(**configs) -> dict:
    return {"dtype": "bfloat16", "configs": {"E=8,N=64,K=32": {"16": CFG16, "64": CFG64}, **configs}}


def test_table_config_is_picked_for_listed_shape_and_token_count(moe):
    t = moe.parse_table(doc(), "test")
    w = torch.empty(8, 64, 32, dtype=torch.bfloat16)
    for tokens, want in [(1, CFG16), (16, CFG16), (17, CFG64), (64, CFG64), (5000, CFG64)]:
        assert moe.tiles(w, tokens, 2, t) == want, tokens
    # another shape or dtype: the defaults
    assert moe.tiles(torch.empty(8, 64, 48, dtype=torch.bfloat16), 16, 2, t) == moe._config(16 * 2 / 8, 64)
    assert moe.tiles(w.half(), 16, 2, t) == moe._config(16 * 2 / 8, 64)
    assert moe.tiles(w, 300, 2, moe.NO_TABLE) == moe._config(300 * 2 / 8, 64)
    assert moe.shape_key(*w.shape) in doc()["configs"]


def test_device_table_is_read_from_its_file_once(moe, table_dir):
    cpu = torch.device("cpu")
    assert moe.device_table(cpu) is moe.NO_TABLE   # no file: the defaults
    assert moe.table_path("NVIDIA H200") == table_dir / "NVIDIA_H200.json"
    moe._TABLES.clear()
    (table_dir / "cpu.json").write_text(json.dumps(doc()))
    t = moe.device_table(cpu)
    assert t.pick(8, 64, 32, 40, torch.bfloat16) == CFG64
    (table_dir / "cpu.json").unlink()
    assert moe.device_table(cpu) is t   # once a process


BAD = [
    ({"configs": {}}, "dtype"),
    (doc(**{"E=8,N=64": {"1": CFG16}}), "E=..,N=..,K=.."),
    (doc(**{"E=8,N=64,K=48": {}}), "non-empty"),
    (doc(**{"E=8,N=64,K=48": {"0": CFG16}}), "token count '0'"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, BLOCK_N=96)}}), "BLOCK_N 96 is not a power of two"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, BLOCK_M=8)}}), "BLOCK_M 8"),
    (doc(**{"E=8,N=64,K=48": {"4": {"BLOCK_SIZE_M": 16, **CFG16}}}), "keys"),
    (doc(**{"E=8,N=64,K=48": {"4": {k: v for k, v in CFG16.items() if k != "num_stages"}}}), "keys"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, num_warps=3)}}), "num_warps 3"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, num_stages="3")}}), "num_stages '3'"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, SPLIT_K=0)}}), "SPLIT_K 0"),
    (doc(**{"E=8,N=64,K=48": {"4": dict(CFG16, BLOCK_K=True)}}), "BLOCK_K True"),
]


@pytest.mark.parametrize("bad, words", BAD, ids=[w for _, w in BAD])
def test_bad_table_is_refused_and_ignored_at_serving(moe, table_dir, caplog, bad, words):
    path = table_dir / "cpu.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=f"cpu.json.*{re.escape(words)}"):
        moe.load_table(path)
    with caplog.at_level(logging.WARNING, logger="zerod.engine"):
        assert moe.device_table(torch.device("cpu")) is moe.NO_TABLE
    assert "MoE tile table ignored" in caplog.text and words.split()[0] in caplog.text


def test_unreadable_table_is_ignored_at_serving(moe, table_dir, caplog):
    (table_dir / "cpu.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        moe.load_table(table_dir / "cpu.json")
    with caplog.at_level(logging.WARNING, logger="zerod.engine"):
        assert moe.device_table(torch.device("cpu")) is moe.NO_TABLE
    assert "not JSON" in caplog.text


# --------------------------------------------------------------------------- the kernel with tables

# w13 [E, 2I, H], w2 [E, H, I]: I = 48 leaves a ragged last K step at BLOCK_K 32; SPLIT_K 4
# there leaves two splits empty (zeros), SPLIT_K 3 at BLOCK_K 16 three full ones; w2's
# BLOCK_M differs from w13's on purpose (fused_experts runs w2 at w13's)
INTERPRETER_SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter
patch_triton_interpreter()
from zerod.engine.model import ops
from zerod.engine.kernels import moe
from zerod.engine.model.moe import fused_experts_reference
from test_families_moe import _case

def cfg(bm, bn, bk, split=1):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2, SPLIT_K=split)

bad = 0
for t, h, i, e, k, dtype, skew, c13, c2 in [
        (1, 64, 48, 8, 2, torch.float32, False, cfg(16, 32, 32), cfg(16, 32, 32, 4)),
        (37, 64, 48, 8, 2, torch.float32, True, cfg(32, 16, 32, 2), cfg(16, 64, 16, 3)),
        (20, 32, 48, 16, 4, torch.float16, True, cfg(16, 64, 16), cfg(32, 16, 32, 2))]:
    x, w13, w2, w, ids = _case(t, h, i, e, k, dtype, skew)
    name = str(dtype).removeprefix("torch.")
    table = moe.parse_table({"dtype": name, "configs": {moe.shape_key(*w13.shape): {"64": c13},
                                                         moe.shape_key(*w2.shape): {"64": c2}}}, "test")
    assert table.pick(*w2.shape, t, dtype)["SPLIT_K"] == c2["SPLIT_K"]
    got = moe.fused_experts(x, w13, w2, w, ids, ops.silu_and_mul, table=table)
    again = moe.fused_experts(x, w13, w2, w, ids, ops.silu_and_mul, table=table)
    want = fused_experts_reference(x.float(), w13.float(), w2.float(), w, ids, ops.silu_and_mul)
    rel = ((got.float() - want).norm() / want.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    ok = rel <= tol and bool(torch.isfinite(got).all()) and torch.equal(got, again)
    bad += not ok
    print("PASS" if ok else "FAIL", t, h, i, e, k, dtype, c13, c2, f"rel={rel:.2e}")
print("RESULT", "ok" if not bad else "bad")
"""


@pytest.mark.slow   # seconds: Triton's interpreter (tests/conftest.py's SLOW_MODULES kind)
def test_fused_experts_with_table_configs_in_interpreter():
    run_in_interpreter(INTERPRETER_SCRIPT)


# --------------------------------------------------------------------------- the sweep

@pytest.fixture(scope="module")
def tune():
    return gpu_scripts.load("moe_tune")


def test_sweep_candidates_fit_and_include_the_defaults(tune, moe):
    cands = tune.candidates(tune.GRID)
    assert 60 <= len(cands) <= 200
    for c in cands:
        assert moe.check_config(c) is None
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"] <= tune.SMEM_MAX
    for avg, n in [(0.25, 28672), (8, 4096), (50, 28672), (512, 4096)]:
        assert moe._config(avg, n) in cands
        assert moe._config(avg, n)["BLOCK_M"] in tune.block_ms(avg, tune.GRID["BLOCK_M"])
    assert tune.block_ms(50, tune.GRID["BLOCK_M"]) == [32, 64, 128]
    assert tune.block_ms(0.25, tune.GRID["BLOCK_M"]) == [16, 32]
    assert tune.split_ok(14336, 128, 8, 4) and not tune.split_ok(768, 128, 2, 4)
    assert not tune.split_ok(48, 16, 4, 1)   # the fourth split would be empty


def test_sweep_picks_one_block_m_for_both_gemms(tune):
    def row(gemm, bm, us, ok=True):
        return dict(gemm=gemm, config=dict(BLOCK_M=bm), us=us, ok=ok)
    rows = [row("w13", 16, 10), row("w2", 16, 30), row("w13", 64, 15), row("w2", 64, 12),
            row("w2", 16, 1, ok=False)]   # wrong: never picked however fast
    bm, b13, b2 = tune.pick(rows, [16, 64])
    assert (bm, b13["us"], b2["us"]) == (64, 15, 12)
    assert tune.pick(rows[:1], [16]) is None


@pytest.mark.slow   # seconds: Triton's interpreter (tests/conftest.py's SLOW_MODULES kind)
def test_sweep_dry_run_writes_a_table_the_engine_loads(tmp_path, moe):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out, table = tmp_path / "moe.json", tmp_path / "table.json"
    # one model: the second adds only time (its path is the same)
    p = subprocess.run([sys.executable, "gpu/moe_tune.py", "--interpret", "--models", "mixtral", "--out", str(out),
                        "--table-out", str(table)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["info"]["interpret"] and not d["stopped_early"]
    assert d["rows"] and all(r["ok"] for r in d["rows"]), [r for r in d["rows"] if not r["ok"]]
    assert any(r["config"].get("SPLIT_K", 1) > 1 for r in d["rows"])
    assert any(r["current"] for r in d["rows"])
    t = moe.load_table(table)
    assert t.dtype == "float16" and len(t.shapes) == 2   # w13, w2
    assert all(ts == [1, 33] for ts, _ in t.shapes.values())
    for c in d["cells"]:
        assert c["best"]["w13"]["config"]["BLOCK_M"] == c["best"]["w2"]["config"]["BLOCK_M"]
        assert c["layer_tuned_us"] > 0 and c["layer_current_us"] > 0 and c["speedup"] > 0
    assert "speedup" in p.stdout
