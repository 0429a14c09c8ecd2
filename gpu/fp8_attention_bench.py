"""A candidate FP8 (e4m3) causal attention for fresh prompts, measured against the
engine's bf16 path; the engine does not ship it (docs/perf.md, "FP8": 1.2x cuDNN at 16K
with 4-9 % error, short of what the FP8 16K target needs).

The kernel follows FlashAttention-3's FP8 recipe in Triton: Q saturated to e4m3, K and V
quantized as an FP8 KV cache stores them (divided by the layer's scale, saturated to
±448), each tile of probabilities P cast to e4m3 before P·V, both products summed in
float32. `_quantize_kv` writes K as [Hk, N, D] and V transposed as [Hk, D, Np] (the FP8
tensor-core product takes its second operand with the reduced dimension contiguous, for
P·V V's sequence dimension); `_attention` runs one program per (block of queries, query
head), the longest rows first, the key tiles before the block unmasked.

It is timed against `_sdpa_varlen` (cuDNN above `sdpa_flash_max_len`, flash below), SDPA's
flash and cuDNN backends, per prompt length, on the Llama-3-8B shape (32 query heads, 8 KV
heads, head_dim 128; q, k, v strided views of one qkv row as the model makes them).
Accuracy against float32 attention of the unquantized inputs, beside bf16 SDPA's own error
and a torch emulation of the same roundings. Prints one JSON line per measurement, then a
table.

    python3 gpu/fp8_attention_bench.py [--lengths 1024,2048,4096,8192,16384] [--configs all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # zerod from the checkout

from step_breakdown import LLAMA3_8B  # noqa: E402
from zerod.engine.model.decoder import _sdpa_varlen  # noqa: E402
from zerod.engine.tuning import Tuning  # noqa: E402

FP8 = torch.float8_e4m3fn
_LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest at 16K on the H100 and the H200
CONFIG = (128, 128, 8, 3)


@triton.jit(do_not_specialize=["N"])
def _quantize_kv(k_ptr, v_ptr, k8_ptr, vt8_ptr, N, Np, inv_k_scale, inv_v_scale,
                 stride_kn, stride_kh, stride_vn, stride_vh,
                 D: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    live = n[:, None] < N
    k = tl.load(k_ptr + n[:, None] * stride_kn + h * stride_kh + d[None, :], mask=live, other=0.0)
    v = tl.load(v_ptr + n[:, None] * stride_vn + h * stride_vh + d[None, :], mask=live, other=0.0)
    k8 = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0).to(tl.float8e4nv)
    v8 = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(k8_ptr + h * N * D + n[:, None] * D + d[None, :], k8, mask=live)
    # zeros past N up to Np: the attention kernel reads V's last tile whole
    tl.store(vt8_ptr + h * D * Np + d[None, :] * Np + n[:, None], v8, mask=n[:, None] < Np)


@triton.jit
def _tile(acc, m_i, l_i, q, k_base, vt_base, n0, offs_m, N, Np, qk_scale,
          D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if MASKED:
        kt = tl.load(k_base + offs_n[None, :] * D + d[:, None], mask=offs_n[None, :] < N, other=0.0)
    else:
        kt = tl.load(k_base + offs_n[None, :] * D + d[:, None])
    qk = tl.dot(q, kt)
    if MASKED:
        qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
    # the softmax scale (times log2 e, times K's scale) in one FMA per score
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    p8 = p.to(tl.float8e4nv)
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(vt_base + d[:, None] * Np + offs_n[None, :])
    acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["N"])
def _attention(q_ptr, k8_ptr, vt8_ptr, o_ptr, N, Np, qk_scale, v_scale,
               stride_qn, stride_qh, stride_on, stride_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = (N + BLOCK_M - 1) // BLOCK_M - 1 - tl.program_id(0)   # the longest rows first
    h = tl.program_id(1)
    kh = h // G
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    rows = offs_m[:, None] < N
    q = tl.load(q_ptr + offs_m[:, None] * stride_qn + h * stride_qh + d[None, :], mask=rows, other=0.0)
    q = tl.clamp(q.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
    k_base = k8_ptr + kh * N * D
    vt_base = vt8_ptr + kh * D * Np
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo = start_m * BLOCK_M
    for n0 in range(0, lo, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, vt_base, n0, offs_m, N, Np, qk_scale,
                              D, BLOCK_N, False)
    for n0 in range(lo, tl.minimum(lo + BLOCK_M, N), BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_base, vt_base, n0, offs_m, N, Np, qk_scale,
                              D, BLOCK_N, True)
    o = acc * (v_scale / l_i)[:, None]
    tl.store(o_ptr + offs_m[:, None] * stride_on + h * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rows)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                block_n: int = CONFIG[1]):
    """k, v [N, Hk, D] -> (K [Hk, N, D], Vᵀ [Hk, D, Np]) in e4m3; Np covers the last
    diagonal tile whole (N rounded up to 128, plus one tile), zeros past N."""
    n, hk, d = k.shape
    np_ = -(-n // 128) * 128 + block_n
    k8 = torch.empty(hk, n, d, dtype=FP8, device=k.device)
    vt8 = torch.empty(hk, d, np_, dtype=FP8, device=k.device)
    block = 64
    _quantize_kv[(triton.cdiv(np_, block), hk)](
        k, v, k8, vt8, n, np_, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), D=d, BLOCK=block)
    return k8, vt8


def fp8_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         k_scale: float = 1.0, v_scale: float = 1.0, config=CONFIG) -> torch.Tensor:
    """q [N, Hq, D], k and v [N, Hk, D] (bf16 or fp16; any row stride, D contiguous) ->
    [N, Hq, D] in q's dtype: causal attention with Q, K, V and P in e4m3."""
    n, hq, d = q.shape
    hk = k.shape[1]
    block_m, block_n, warps, stages = config
    assert block_m % block_n == 0 and block_m <= 128, "the diagonal is whole key tiles"
    k8, vt8 = quantize_kv(k, v, k_scale, v_scale, block_n)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    _attention[(triton.cdiv(n, block_m), hq)](
        q, k8, vt8, out, n, vt8.shape[2], scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G=hq // hk, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return out


HQ, HK, D = LLAMA3_8B.heads, LLAMA3_8B.kv_heads, LLAMA3_8B.head_dim
CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4),
           (128, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)]


def inputs(n: int, sigma_q: float, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(n, (HQ + 2 * HK) * D, device="cuda", generator=g, dtype=torch.float32)
    qkv[:, :HQ * D] *= sigma_q
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], -1)
    return q.view(n, HQ, D), k.view(n, HK, D), v.view(n, HK, D)


def timed(fn, reps: int = 15) -> float:
    """Median ms of reps calls after three warm-ups, each between CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def exact(q, k, v, scale):
    """float32 causal attention, a head at a time (an [N, N] score matrix each)."""
    n = q.shape[0]
    g = HQ // HK
    out = torch.empty(n, HQ, D, device="cuda")
    hide = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)
    for h in range(HQ):
        s = (q[:, h].float() @ k[:, h // g].float().T) * scale
        out[:, h] = s.masked_fill_(hide, float("-inf")).softmax(-1) @ v[:, h // g].float()
    return out


def emulated(q, k, v, scale):
    """The kernel's roundings in torch: Q, K, V and the probabilities in e4m3 (each row's
    probabilities against its final maximum, where the kernel's are against a running one)."""
    n = q.shape[0]
    g = HQ // HK
    e4 = lambda x: x.float().clamp(-448, 448).to(FP8).float()  # noqa: E731
    out = torch.empty(n, HQ, D, device="cuda")
    hide = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)
    for h in range(HQ):
        s = (e4(q[:, h]) @ e4(k[:, h // g]).T * scale).masked_fill_(hide, float("-inf"))
        p = (s - s.max(-1, keepdim=True).values).exp()
        out[:, h] = (e4(p) @ e4(v[:, h // g])) / p.sum(-1, keepdim=True)
    return out


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--configs", default="all", help="all, or the default config only: default")
    args = ap.parse_args()
    scale = D ** -0.5
    tuning = Tuning()
    configs = CONFIGS if args.configs == "all" else [CONFIG]
    rows = []

    def emit(**kw):
        print(json.dumps(kw), flush=True)
        rows.append(kw)

    # accuracy (one length; both the flat and a peaked softmax)
    for sigma in (1.0, 3.0):
        q, k, v = inputs(4096, sigma)
        ref = exact(q, k, v, scale)
        emit(kind="accuracy", n=4096, sigma_q=sigma,
             bf16_sdpa=rel(_sdpa_varlen(q, k, v, [4096], scale, tuning), ref),
             fp8=rel(fp8_causal_attention(q, k, v, scale), ref), emulated=rel(emulated(q, k, v, scale), ref))
    for n in (1, 77, 1000, 1029):   # odd lengths: the masked tails
        q, k, v = inputs(n, 1.0, seed=n)
        emit(kind="accuracy", n=n, sigma_q=1.0, bf16_sdpa=rel(_sdpa_varlen(q, k, v, [n], scale, tuning),
             exact(q, k, v, scale)), fp8=rel(fp8_causal_attention(q, k, v, scale), exact(q, k, v, scale)))

    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v = inputs(n, 1.0)
        flops = 2 * n * n * D * HQ   # causal: half of 4·N²·D a head
        t = {"engine_bf16": timed(lambda: _sdpa_varlen(q, k, v, [n], scale, tuning))}
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t["flash_bf16"] = timed(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                            scale=scale, enable_gqa=True))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            try:
                t["cudnn_bf16"] = timed(lambda: F.scaled_dot_product_attention(
                    qb.contiguous(), kb.contiguous(), vb.contiguous(), is_causal=True, scale=scale, enable_gqa=True))
            except RuntimeError as e:
                emit(kind="skip", n=n, what="cudnn_bf16", why=str(e)[:200])
        t["quantize_kv"] = timed(lambda: quantize_kv(k, v))
        for c in configs:
            t["fp8 " + "/".join(map(str, c))] = timed(lambda: fp8_causal_attention(q, k, v, scale, config=c))
        for name, ms in t.items():
            emit(kind="time", n=n, what=name, ms=round(ms, 4),
                 tflops=None if name == "quantize_kv" else round(flops / ms / 1e9, 1))
        del q, k, v, qb, kb, vb
        torch.cuda.empty_cache()

    print()
    print(f"device: {torch.cuda.get_device_name()}")
    print("| length | " + " | ".join(sorted({r['what'] for r in rows if r['kind'] == 'time'})) + " |")
    names = sorted({r["what"] for r in rows if r["kind"] == "time"})
    for n in sorted({r["n"] for r in rows if r["kind"] == "time"}):
        cells = {r["what"]: r for r in rows if r["kind"] == "time" and r["n"] == n}
        print(f"| {n} | " + " | ".join(
            f"{cells[w]['ms']:.3f} ms" + (f" ({cells[w]['tflops']:.0f})" if cells[w]["tflops"] else "")
            if w in cells else "–" for w in names) + " |")


if __name__ == "__main__":
    main()
