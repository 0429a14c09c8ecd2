"""RMSNorm and residual-add + RMSNorm, one program per row.

Rounding as Hugging Face's LlamaRMSNorm: the row is normalised in float32, cast
to the activation dtype, then multiplied by the weight. The fused version also
rounds `x + residual` to the activation dtype first (HF adds in bf16), and
returns that sum as the new residual.
Bytes: read x (and residual) once, write the outputs once; the weight stays in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr,
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
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _launch(x, residual, weight, eps):
    H = x.shape[-1]
    x2 = _rows(x)
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((n_rows, H), dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(H)
    num_warps = 8 if block >= 4096 else (4 if block >= 1024 else 2)
    if residual is None:
        if n_rows:
            _rms_norm_kernel[(n_rows,)](
                x2, x2, weight, out, out,
                x2.stride(0), 0, out.stride(0), 0,
                H, float(eps),
                HAS_RESIDUAL=False, BLOCK=block, num_warps=num_warps,
            )
        return out.view(x.shape), None
    r2 = _rows(residual)
    res_out = torch.empty((n_rows, H), dtype=x.dtype, device=x.device)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            H, float(eps),
            HAS_RESIDUAL=True, BLOCK=block, num_warps=num_warps,
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x, residual, weight, eps):
    """-> (rms_norm(x + residual), x + residual)"""
    return _launch(x, residual, weight, eps)
