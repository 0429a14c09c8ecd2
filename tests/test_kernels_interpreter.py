"""The Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Runs where Triton is installed, GPU or not (CI when its torch brings Triton).
The interpreter must be switched on before the kernels are defined, so each
group runs in a fresh subprocess. Interpreter quirks (seen with triton 3.6):
tl.dot on bf16 is wrong there, so attention is checked in fp16; bf16 stores
truncate rather than round, so bf16 errors are about twice the GPU's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import sys, torch
from zerod.engine.kernels import load_kernels
from kernel_checks import run_all, patch_triton_interpreter
patch_triton_interpreter()
res = run_all(load_kernels(), torch.device("cpu"), big=False, only=set(sys.argv[1:]), seed=5)
for r in res:
    print(r.line())
print("RESULT", "ok" if res and all(r.ok for r in res) else "bad")
"""


@pytest.mark.parametrize("names", [
    ["rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul", "write_kv"],
    ["decode_attention"],
    ["prefill_attention"],
], ids=["small-ops", "decode", "prefill"])
def test_kernels_in_interpreter(names):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, *names], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert "RESULT ok" in p.stdout, p.stdout + p.stderr[-4000:]
