"""SiLU(gate) * up over the fused gate_up projection: [T, 2I] -> [T, I].

Rounding as HF's Llama MLP: silu rounded to the activation dtype, then the
product rounded again. Bytes: read 2I, write I per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, (s * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(inter))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)
