"""The Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Runs where Triton is installed, GPU or not (CI when its torch brings Triton).
The interpreter must be switched on before the kernels are defined, so each
group runs in a fresh subprocess. Interpreter quirks (seen with triton 3.6):
tl.dot on bf16 is wrong there, so attention is checked in fp16; bf16 stores
truncate rather than round, so bf16 errors are about twice the GPU's.
"""

from __future__ import annotations

import pytest

from kernel_checks import run_in_interpreter

pytest.importorskip("triton")


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
    ["rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul", "write_kv", "rope_write_kv"],
    ["decode_attention"],
    ["prefill_attention"],
], ids=["small-ops", "decode", "prefill"])
def test_kernels_in_interpreter(names):
    run_in_interpreter(SCRIPT, *names)
