"""`Fp8Linear`: a projection with e4m3 weights, plugged into linear.py's seam.

The model builds every projection through `build_linear`, which gives an `Fp8Linear`
where the quantization covers the module and a plain `Linear` where it does not (the
checkpoint's `ignore` list, the LM head under `--quantization fp8`).

Buffers: `weight` float8_e4m3fn [out, in] (row-major, so `weight.t()` is the column-major
B that `torch._scaled_mm` wants); `weight_scale` float32, one per output row (a per-tensor
checkpoint scale is copied to each row of its part: q, k and v fused keep their own) or,
for block weights, one per [bn, bk] block; `input_scale` float32 [1] for static
activations (fused parts: the largest, as vLLM).

The product on CUDA (compute capability >= 8.9), chosen by M (the step's tokens: a host
decision on the shape, so each captured decode graph keeps its path; `Fp8Linear.way`):
- where the device's skinny GEMM table lists this shape and M (Tuning.skinny_gemm_table,
  off by default; kernels/gemm_table.py), per-row weights and per-token activations: the
  activations quantized per token, the skinny Triton FP8 GEMM, scales in its epilogue.
- M = 1 (batch-1 decode), per-row weights and per-token activations: the token quantized,
  cuBLASLt's tensorwise FP8 GEMM, the weights' row scales on the output (Tuning.fp8_one_token_tensorwise);
  above W8A16's rows and up to Tuning.fp8_tensorwise_max_m (200), the same GEMM with unit
  scales, the tokens' and the weights' scales on its float32 output.
- M <= W8A16_MAX_M (decode), bf16 / fp16: triton_w8a16, the activations as they are times the e4m3
  weights, scales on the float32 accumulator; no activation quantization (more exact
  than W8A8, and what reads only the weight bytes). Weight-only checkpoints take it at
  every M.
- above (prefill chunks): activations quantized per token by one Triton kernel, then `torch._scaled_mm`
  with per-row A and per-column B scales (cuBLASLt), or the Triton block kernel for block
  weights (the FP8 tensor cores' throughput, for prefill).
Elsewhere, and for shapes cuBLASLt refuses (a dimension not a multiple of 16), the
reference: weights dequantized, activations quantized and dequantized the same way
(W8A8 emulated), one F.linear. Under Tuning.fp8_fast_accum every cuBLASLt GEMM above keeps
its sums in the tensor cores' accumulator, never promoted to float32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..tuning import Tuning
from ..kernels import gemm_table
from ..config import EngineError
from ..model.linear import Linear, param
from . import fp8
from ..spec.quant import QuantConfig, quantizes

MIN_CAPABILITY = (8, 9)   # e4m3 tensor cores: Ada (sm_89), Hopper (sm_90) and newer
# The largest M that takes the W8A16 kernel, per weight scales (per-row, block): where it
# stops beating activation quantization + the W8A8 GEMM. Measured on the H200
# (gpu/fp8_gemm_bench.py, docs/perf.md "FP8"): per-row
# W8A16 wins to M = 16 (102-108 vs 128-135 us a layer), loses at 64 (160 vs 121). Block
# W8A16 (KERNEL's kernel for block scales) beats block W8A8 to M = 64, loses at 200 (its
# decode graphs capture since every bucket is warmed first: tests/test_fp8_checkpoints.py).
W8A16_MAX_M = {"row": 16, "block": 64}


def check_device(device: torch.device) -> None:
    """FP8 GEMMs need sm_89+; the CPU runs the reference."""
    if device.type != "cuda":
        return
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CAPABILITY:
        raise EngineError(f"FP8 needs compute capability 8.9 or newer (Ada, Hopper); "
                          f"{torch.cuda.get_device_name(device)} is {cc[0]}.{cc[1]}: serve an "
                          f"unquantized checkpoint, without --quantization fp8 / --kv-cache-dtype fp8")


class Fp8Linear(Linear):
    def __init__(self, out_features: int, in_features: int, *, bias: bool, dtype, device,
                 scheme: QuantConfig):
        nn.Module.__init__(self)   # not Linear's: its weight would be allocated in `dtype` first
        self.out_features, self.in_features = out_features, in_features
        self.act_dtype = dtype     # the activations' (and the output's)
        self.scheme = scheme
        self.tuning = Tuning()   # the model's, set by LlamaModel.tuning
        self.weight = param(out_features, in_features, dtype=fp8.FP8, device=device)
        self.bias = param(out_features, dtype=dtype, device=device) if bias else None
        if scheme.weights == "block":
            bn, bk = scheme.block
            shape = (-(-out_features // bn), -(-in_features // bk))
        else:
            shape = (out_features,)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.zeros(1, dtype=torch.float32, device=device)
                             if scheme.activations == "static" else None)
        # cuBLASLt's FP8 GEMM wants K and N multiples of 16
        self.cublas_ok = in_features % 16 == 0 and out_features % 16 == 0

    # ------------------------------------------------------------------ weights
    @torch.inference_mode()
    def set_weight(self, w: torch.Tensor, row0: int = 0) -> None:
        """Quantize float rows w into rows row0.. (the scheme's granularity: per-row scales
        for tensor / channel, per-block for block, where row0 must start a block)."""
        n = w.shape[0]
        if self.scheme.weights == "block":
            bn = self.scheme.block[0]
            q, s = fp8.quantize_blocks(w.to(self.weight.device), self.scheme.block)
            self.weight.data[row0:row0 + n].copy_(q)
            self.weight_scale[row0 // bn:row0 // bn + s.shape[0]].copy_(s)
        else:
            q, s = fp8.quantize_rows(w.to(self.weight.device))
            self.weight.data[row0:row0 + n].copy_(q)
            self.weight_scale[row0:row0 + n].copy_(s)

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: the weights as the checkpoint means them."""
        if self.scheme.weights == "block":
            return fp8.dequantize_blocks(self.weight, self.weight_scale, self.scheme.block)
        return self.weight.float() * self.weight_scale.unsqueeze(1)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor | fp8.Fp8Acts) -> torch.Tensor:
        if isinstance(x, fp8.Fp8Acts):   # quantized by the kernel before (takes_fp8)
            return self.w8a8_tensorwise(x) if self.way(x.q) == "tensorwise" else self.w8a8(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        way = self.way(x2)
        if way == "tensorwise":
            y = self.w8a8_tensorwise(x2)
        elif way == "w8a16":
            y = self.w8a16(x2)
        elif way == "w8a8":
            y = self.w8a8(x2)
        else:
            y = self.reference(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def takes_fp8(self, x: torch.Tensor) -> bool:
        """Per-token dynamic activations into row-wise or tensorwise FP8 GEMMs: the RMSNorm
        or SiLU·mul before quantizes them in its own kernel (one launch fewer a projection)."""
        return (self.tuning.fp8_fused_act_quant and self.lora is None and self.scheme.weights != "block"
                and self.scheme.activations == "token" and x.dtype == self.act_dtype
                and self.way(x) in ("tensorwise", "w8a8"))

    def way(self, x: torch.Tensor) -> str:
        """The product x [M, K] takes: "tensorwise", "w8a16", "w8a8" or "reference" (a host
        decision on the shape, so each captured decode graph keeps its way)."""
        m = x.shape[0]
        if not x.is_cuda:
            return "reference"
        if (gemm_table.cells and self.scheme.weights != "block" and self.scheme.activations == "token"
                and gemm_table.choice(fp8.FP8, self.weight.shape[0], self.weight.shape[1], m) is not None):
            return "w8a8"   # the device table lists a skinny Triton tile here (gemm_table.py)
        if (self.tuning.fp8_one_token_tensorwise and m == 1 and self.cublas_ok and self.scheme.weights != "block"
                and self.scheme.activations == "token"):
            return "tensorwise"
        if x.dtype in (torch.bfloat16, torch.float16) and (
                self.scheme.activations == "none"
                or m <= W8A16_MAX_M["block" if self.scheme.weights == "block" else "row"]):
            return "w8a16"
        if (m <= self.tuning.fp8_tensorwise_max_m and self.cublas_ok and self.scheme.weights != "block"
                and self.scheme.activations == "token"):
            return "tensorwise"
        if self.scheme.activations != "none" and (self.cublas_ok or self.scheme.weights == "block"):
            return "w8a8"
        return "reference"

    def w8a16(self, x: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        """x [M, K] bf16 / fp16 times the dequantized weights, in one Triton GEMM (+ its split-K
        sum); kernel: one of triton_w8a16's (None: its KERNEL; the bench times each)."""
        from .triton_w8a16 import w8a16_matmul

        return w8a16_matmul(x, self.weight, self.weight_scale, self.bias,
                            self.scheme.block if self.scheme.weights == "block" else None, kernel=kernel)

    def w8a8(self, x: torch.Tensor | fp8.Fp8Acts) -> torch.Tensor:
        """x quantized as the scheme says (or already, per token), then the FP8 GEMM
        (cuBLASLt, or Triton for blocks)."""
        from . import triton_fp8

        if self.scheme.weights == "block" and not isinstance(x, fp8.Fp8Acts):
            bk = self.scheme.block[1]
            xq, xs = triton_fp8.quantize_token_groups(x, bk)
            y = triton_fp8.block_fp8_matmul(xq, xs, self.weight, self.weight_scale, self.scheme.block, x.dtype)
            return y if self.bias is None else y + self.bias
        if isinstance(x, fp8.Fp8Acts):
            xq, xs = x.q, x.scale
        else:
            xq, xs = triton_fp8.quantize_tokens(x, self.input_scale)
            if self.input_scale is not None:
                xs = xs.contiguous()   # rowwise scaling wants a real [T, 1] tensor
        cfg = gemm_table.choice(fp8.FP8, self.weight.shape[0], self.weight.shape[1], xq.shape[0]) \
            if gemm_table.cells else None
        if cfg is not None:   # the device measured a skinny Triton tile faster here
            return gemm_table.kernels().skinny_matmul_fp8(xq, xs, self.weight, self.weight_scale, bias=self.bias,
                                                          out_dtype=self.act_dtype, cfg=cfg)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.view(1, -1),
                             out_dtype=self.act_dtype, use_fast_accum=self.tuning.fp8_fast_accum)
        return y if self.bias is None else y + self.bias

    def w8a8_tensorwise(self, x: torch.Tensor | fp8.Fp8Acts, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The same product as w8a8 (per-token dynamic activations, per-row weights) through
        cuBLASLt's tensorwise FP8 GEMM with unit scales, then the tokens' and the weights'
        scales, the cast to the activations' dtype and the bias in one kernel after
        (triton_fp8.scale_columns: torch's mul into a bf16 output took 2.6 us a launch on
        the H200, more than a float32 mul and a cast; docs/perf.md "FP8"). One token's
        scale is the whole tensor's, so it goes to the GEMM itself. out_dtype: the GEMM's
        output before the scales (float32: one rounding, as w8a8's)."""
        from . import triton_fp8

        xq, xs = x if isinstance(x, fp8.Fp8Acts) else triton_fp8.quantize_tokens(x)
        one = _one(xq.device)
        if xq.shape[0] == 1:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs.reshape(()), scale_b=one, out_dtype=out_dtype,
                                 use_fast_accum=self.tuning.fp8_fast_accum)
            return triton_fp8.scale_columns(y, self.weight_scale, self.act_dtype, self.bias)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=one, scale_b=one, out_dtype=out_dtype,
                             use_fast_accum=self.tuning.fp8_fast_accum)
        return triton_fp8.scale_columns(y, self.weight_scale, self.act_dtype, self.bias, row_scale=xs.reshape(-1))

    def reference(self, x: torch.Tensor, quantize_activations: bool = True) -> torch.Tensor:
        """The CPU's product, and the check of the CUDA one: dequantized weights, and the
        activations through FP8 and back as the kernels quantize them (as is with
        quantize_activations False: the W8A16 kernel's product)."""
        acts = self.scheme.activations if quantize_activations else "none"
        if acts == "token":
            x = fp8.qdq_groups(x, self.scheme.block[1]) if self.scheme.weights == "block" else fp8.qdq_rows(x)
        elif acts == "static":
            x = fp8.qdq_static(x, self.input_scale)
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A float32 scalar 1 on device (the tensorwise GEMM's weight scale), made once."""
    return torch.ones((), dtype=torch.float32, device=device)


def build_linear(quant: QuantConfig | None, parts: list[tuple[str, int]], in_features: int,
                 *, bias: bool, dtype, device) -> Linear:
    """The projection of the HF modules `parts` ((name, rows), fused in order: q/k/v,
    gate/up), quantized as the checkpoint or flag says (spec/quant.quantizes)."""
    out_features = sum(rows for _, rows in parts)
    if not quantizes(quant, parts, in_features):
        return Linear(out_features, in_features, bias=bias, dtype=dtype, device=device)
    return Fp8Linear(out_features, in_features, bias=bias, dtype=dtype, device=device, scheme=quant)
