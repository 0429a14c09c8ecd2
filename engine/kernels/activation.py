"""SiLU(gate) * up over the fused gate_up projection: [T, 2I] -> [T, I].

Rounding as HF's Llama MLP: silu rounded to the activation dtype, then the
product rounded again. Bytes: read 2I, write I per row.

quantize=True (an FP8 down projection next: Linear.takes_fp8): one program per row (the
row's amax needs all of it), written as e4m3 with its scale (quant.fp8.Fp8Acts), what
quantize_tokens would make of the bf16 output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8, Fp8Acts
from ..quant.triton_fp8 import store_fp8_row


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, s_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    y = (s * u).to(g.dtype)
    if QUANT:   # BLOCK covers the row
        store_fp8_row(y.to(tl.float32), offs, mask, o_ptr + row * stride_o, s_ptr, row)
    else:
        tl.store(o_ptr + row * stride_o + offs, y, mask=mask)


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    out = torch.empty((T, inter), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty((T, 1), dtype=torch.float32, device=x.device) if quantize else out
    block = triton.next_power_of_2(inter) if quantize else min(2048, triton.next_power_of_2(inter))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
            x2, out, scale, x2.stride(0), out.stride(0), inter, BLOCK=block, QUANT=quantize,
            num_warps=16 if block >= 8192 else 4,
        )
    return Fp8Acts(out, scale) if quantize else out.view(*x.shape[:-1], inter)
