#!/usr/bin/env python3
"""Compile the decode/prefill kernels for sm_90a without a GPU and report ptxas's
registers, spills and shared memory, and which MMA instructions the PTX holds.

Runs on a CPU-only machine with Triton installed (costs no device time):
    python gpu/kernels_aot.py
Pointer and stride arguments are marked 16-divisible, as Triton's JIT specialises
them at run time; without that the loads compile to scalar 2-byte loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zerod.engine.kernels import decode_attention as da  # noqa: E402
from zerod.engine.kernels import prefill_attention as pa  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
P, F, I = "*bf16", "*fp32", "*i32"


def attrs(sig):
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
            if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_btb") or n == "HQ"}


def report(fn, sig, consts, nw, ns, label):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs(sig)),
                       target=TARGET, options={"num_warps": nw, "num_stages": ns})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info = " ; ".join(x.split("info    : ")[-1].strip() for x in r.stderr.splitlines()
                      if "registers" in x or "spill" in x)
    ptx = k.asm["ptx"]
    mma = f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')} cp.async={ptx.count('cp.async.c')}"
    print(f"{label:40s} smem={k.metadata.shared:6d} {mma} | {info}")


def main():
    dsig = {"q_ptr": P, "kc_ptr": P, "vc_ptr": P, "bt_ptr": I, "cl_ptr": I, "out_ptr": P, "mid_o_ptr": F,
            "mid_lse_ptr": F, "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32", "stride_cp": "i32",
            "stride_cs": "i32", "stride_ch": "i32", "stride_btb": "i32", "stride_ob": "i32", "stride_oh": "i32",
            "HQ": "i32", "PAGE_SIZE": "constexpr", "GROUP": "constexpr", "BLOCK_H": "constexpr", "D": "constexpr",
            "BLOCK_N": "constexpr", "NUM_SPLITS": "constexpr"}
    for s, bn, nw, st in [(1, 64, 4, 2), (64, 64, 4, 2), (1, 32, 4, 3), (64, 16, 4, 3), (4, 128, 8, 2)]:
        report(da._decode_split_kernel, dsig, {"PAGE_SIZE": 16, "GROUP": 4, "BLOCK_H": 16, "D": 128,
                                                "BLOCK_N": bn, "NUM_SPLITS": s}, nw, st,
               f"decode splits={s} N={bn} w={nw} st={st}")
    psig = {"q_ptr": P, "kc_ptr": P, "vc_ptr": P, "bt_ptr": I, "cu_ptr": I, "cl_ptr": I, "o_ptr": P,
            "qk_scale": "fp32", "B": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
            "stride_oh": "i32", "stride_cp": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_btb": "i32",
            "PAGE_SIZE": "constexpr", "GROUP": "constexpr", "D": "constexpr", "BLOCK_M": "constexpr",
            "BLOCK_N": "constexpr"}
    for bm, bn, nw, st in [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4)]:
        report(pa._prefill_kernel, psig, {"PAGE_SIZE": 16, "GROUP": 4, "D": 128, "BLOCK_M": bm, "BLOCK_N": bn},
               nw, st, f"prefill M={bm} N={bn} w={nw} st={st}")


if __name__ == "__main__":
    main()
