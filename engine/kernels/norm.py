"""RMSNorm and residual-add + RMSNorm, one program per row.

Rounding as Hugging Face's LlamaRMSNorm: the row is normalised in float32, cast
to the activation dtype, then multiplied by the weight. The fused version also
rounds `x + residual` to the activation dtype first (HF adds in bf16), and
returns that sum as the new residual.
Bytes: read x (and residual) once, write the outputs once; the weight stays in L2.

quantize=True (an FP8 projection next: Linear.takes_fp8): the normed row is written as
e4m3 with its own scale (quant.fp8.Fp8Acts), exactly what quantize_tokens would make of
the bf16 output, in the same kernel: the row is in registers already.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8, Fp8Acts
from ..quant.triton_fp8 import store_fp8_row


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if QUANT:   # the row as the activation dtype rounds it, then to e4m3
        y = (normed * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        store_fp8_row(y, offs, mask, out_ptr + row * stride_o, s_ptr, row)
    else:
        tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _launch(x, residual, weight, eps, quantize=False):
    H = x.shape[-1]
    x2 = _rows(x)
    n_rows = x2.shape[0]
    out_dtype = FP8 if quantize else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((n_rows, H), dtype=out_dtype, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device) if quantize else out
    block = triton.next_power_of_2(H)
    num_warps = 8 if block >= 4096 else (4 if block >= 1024 else 2)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty((n_rows, H), dtype=x.dtype, device=x.device) if residual is not None else out
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, res_out, scale,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            H, float(eps),
            HAS_RESIDUAL=residual is not None, QUANT=quantize, BLOCK=block, num_warps=num_warps,
        )
    normed = Fp8Acts(out, scale) if quantize else out.view(x.shape)
    return normed, (res_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False):
    return _launch(x, None, weight, eps, quantize)[0]


def fused_add_rms_norm(x, residual, weight, eps, quantize: bool = False):
    """-> (rms_norm(x + residual), x + residual)"""
    return _launch(x, residual, weight, eps, quantize)
