"""The FP8 kernels against their torch references: activation quantization per token and
per group, the block-scaled GEMM, the small-M W8A16 GEMMs (both kernels, and captured in a
CUDA graph on the GPU), `Fp8Linear` on both sides of
its M threshold (W8A16; W8A8 through `torch._scaled_mm`), and the KV
cache's FP8 pages in write_kv and the decode / prefill attention kernels.

On the CPU through Triton's interpreter (it takes float8; one subprocess, the interpreter
must be on before the kernels are defined; attention in fp16 there, as in
test_kernels_interpreter.py), and on the GPU with the real kernels (@gpu). Tolerances:
quantized values within one e4m3 step on the CPU (the interpreter truncates where the GPU
rounds) and equal to 1e-3 on the GPU,
products and attention to 1e-2 relative (the references dequantize in float32).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from kernel_checks import report, run_in_interpreter

pytest.importorskip("triton")



@contextlib.contextmanager
def _tuned(lin, **fields):
    """lin with these Tuning fields changed, its own tuning back after."""
    default = lin.tuning
    lin.tuning = dataclasses.replace(default, **fields)
    try:
        yield lin
    finally:
        lin.tuning = default


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-12))


def run_checks(device: torch.device) -> list[tuple[str, float, float]]:
    """(case, error, tolerance) for every FP8 kernel on device."""
    from zerod.engine.model import ops
    from zerod.engine.kernels import load_kernels
    from zerod.engine.quant import fp8, triton_fp8, triton_w8a16
    from zerod.engine.spec.quant import QuantConfig
    from zerod.engine.quant.linear import W8A16_MAX_M, Fp8Linear
    from zerod.engine.tuning import Tuning

    g = torch.Generator().manual_seed(5)
    adt = torch.bfloat16 if device.type == "cuda" else torch.float16
    rnd = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    out = []
    # quantized values: the interpreter truncates (error up to one e4m3 step, 1/8 relative),
    # the GPU rounds to nearest as torch does (a rare tie apart, equal)
    qtol = 1 / 8 if device.type == "cpu" else 1e-3
    for T, K in [(1, 256), (5, 4096), (3, 14336)]:
        x = rnd(T, K, dt=adt)
        q, s = triton_fp8.quantize_tokens(x)
        rq, rs = fp8.quantize_rows(x)
        out.append((f"quantize_tokens T={T} K={K} scale", _rel(s[:, 0], rs), 1e-6))
        out.append((f"quantize_tokens T={T} K={K} values", _rel(q.float() * s, rq.float() * rs[:, None]), qtol))
        st = torch.tensor([0.01], device=device)
        q2, _ = triton_fp8.quantize_tokens(x, st)
        out.append((f"quantize_tokens static T={T}", _rel(q2.float(), fp8.quantize(x, st).float()), qtol))
        qg, sg = triton_fp8.quantize_token_groups(x, 128)
        rqg, rsg = fp8.quantize_groups(x, 128)
        out.append((f"quantize_token_groups T={T} K={K}", _rel(sg, rsg), 1e-6))
    # the per-channel scales, cast and bias after a float32 product, in one launch
    for T, N, bias in [(1, 3000, False), (3, 640, True)]:
        y, sc, b = rnd(T, N), rnd(N).abs(), rnd(N, dt=adt) if bias else None
        ref = (y * sc).to(adt) + (b if bias else 0)
        out.append((f"scale_columns T={T} N={N} bias={bias}",
                    _rel(triton_fp8.scale_columns(y, sc, adt, b).float(), ref.float()), 0.0))
        # and each row's own scale (the tokens' of a tensorwise GEMM with unit scales)
        rs = rnd(T).abs()
        ref = (y * sc * rs[:, None]).to(adt) + (b if bias else 0)
        out.append((f"scale_columns row scales T={T} N={N} bias={bias}",
                    _rel(triton_fp8.scale_columns(y, sc, adt, b, row_scale=rs).float(), ref.float()), 1e-6))
    # the block GEMM against float32 on the same FP8 operands: exact products, the sums in
    # another order. Hopper's FP8 tensor cores (wgmma, taken from BLOCK_M=64, so M=70 here)
    # keep about 14 bits of the running sum inside one K tile (DeepSeek-V3 report, 3.3.2),
    # so the GPU's error is ~2^-13 (1.3e-4 measured at M=70 on the H200): 1e-3 there, still
    # 60x below one e4m3 step (1/16), which a wrong scale or block index would cost
    mm_tol = 1e-4 if device.type == "cpu" else 1e-3
    for M, N, K in [(1, 384, 256), (17, 256, 512), (70, 640, 384)]:
        a, b = rnd(M, K, dt=adt), rnd(N, K) * 0.05
        aq, as_ = triton_fp8.quantize_token_groups(a, 128)
        bq, bs = fp8.quantize_blocks(b, (128, 128))
        y = triton_fp8.block_fp8_matmul(aq, as_, bq, bs, (128, 128), torch.float32)
        ref = (aq.float().view(M, -1, 128) * as_[..., None]).view(M, K) @ fp8.dequantize_blocks(bq, bs, (128, 128)).t()
        out.append((f"block_fp8_matmul M={M} N={N} K={K}", _rel(y, ref), mm_tol))
    # the W8A16 kernels against the dequantized weights (activations as they are): exact
    # products summed in float32, then rounded to the activations' dtype (bf16 on the GPU:
    # ~1e-3 relative; fp16 in the interpreter: ~2e-4). Their own splits, forced splits
    # (partials summed by the second kernel), a K tail, an N tail, bias, channel and block
    # scales; swap_ab also with tiles other than its defaults (as the bench sweeps them)
    wtol = 5e-3 if adt == torch.bfloat16 else 1e-3
    Tiles = triton_w8a16.Tiles
    cases = [("ab", M, N, K, block, split, bias, None) for M, N, K, block, split, bias in [
        (1, 384, 256, None, None, False), (5, 640, 384, None, 2, True), (17, 256, 1000, None, None, True),
        (70, 640, 384, (128, 128), None, False), (3, 384, 512, (128, 128), 4, True)]]
    for M in (1, 3, 16):
        for block in (None, (128, 128)):
            cases += [("swap_ab", M, 200, 1000, block, None, M > 1, None),   # K, N tails; its split
                      ("swap_ab", M, 384, 512, block, 3, M == 1, None)]      # K whole: unmasked loads
    cases += [("swap_ab", 70, 200, 384, None, None, True, None),             # two row tiles
              # swept tiles (within 99 KB of shared memory: Ada's too)
              ("swap_ab", 16, 200, 1000, None, None, True, Tiles(128, 256, num_stages=3, num_warps=8)),
              ("swap_ab", 3, 384, 1024, None, 2, False, Tiles(64, 512, num_stages=2, num_warps=8, hints=False)),
              ("swap_ab", 5, 384, 512, (128, 128), None, True, Tiles(128, 128, num_stages=3, num_warps=4))]
    for kernel, M, N, K, block, split, bias, tiles in cases:
        x, w = rnd(M, K, dt=adt), rnd(N, K) * 0.05
        wq, ws = fp8.quantize_blocks(w, block) if block else fp8.quantize_rows(w)
        deq = fp8.dequantize_blocks(wq, ws, block) if block else wq.float() * ws[:, None]
        b = rnd(N, dt=adt) if bias else None
        y = triton_w8a16.w8a16_matmul(x, wq, ws, b, block, kernel=kernel, tiles=tiles, split=split)
        ref = x.float() @ deq.t() + (b.float() if bias else 0.0)
        out.append((f"w8a16_matmul {kernel} M={M} N={N} K={K} block={block} split={split} bias={bias} "
                    f"tiles={tiles}", _rel(y.float(), ref), wtol))
    if device.type == "cuda":
        # graph-safe: captured once (split, so the partials come from the graph's pool), then
        # replayed on new activations
        wq, ws = fp8.quantize_rows(rnd(4096, 4096) * 0.05)
        x = rnd(4, 4096, dt=adt)
        for kernel in ("ab", "swap_ab"):
            triton_w8a16.w8a16_matmul(x, wq, ws, kernel=kernel)   # compiled outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = triton_w8a16.w8a16_matmul(x, wq, ws, kernel=kernel)
            x.copy_(rnd(4, 4096, dt=adt))
            graph.replay()
            out.append((f"w8a16_matmul {kernel} replayed from a CUDA graph",
                        _rel(y.float(), x.float() @ (wq.float() * ws[:, None]).t()), wtol))
    if device.type == "cuda":   # torch._scaled_mm: cuBLASLt, CUDA only
        for scheme in (QuantConfig("online", "channel", "token"), QuantConfig("fp8", "tensor", "static"),
                       QuantConfig("fp8", "block", "token", block=(128, 128))):
            lin = Fp8Linear(512, 256, bias=True, dtype=torch.bfloat16, device=device, scheme=scheme)
            lin.set_weight(rnd(512, 256) * 0.05)
            lin.bias.data.copy_(rnd(512, dt=torch.bfloat16))
            if lin.input_scale is not None:
                lin.input_scale.fill_(4.0 / 448)
            small = W8A16_MAX_M["block" if scheme.weights == "block" else "row"]
            for M in (1, 5, 17, small, small + 1, 300):
                # up to `small` tokens the W8A16 kernel (one token of per-token activations:
                # the tensorwise W8A8 GEMM): W8A16's reference leaves activations as they are
                x = rnd(M, 256, dt=torch.bfloat16)
                way = lin.way(x)
                out.append((f"Fp8Linear {scheme.weights}/{scheme.activations} M={M} {way}",
                            _rel(lin(x).float(), lin.reference(x, quantize_activations=way != "w8a16").float()), 1e-2))
                if M == 1 and scheme.weights == "channel":   # the one-token product is the tensorwise one
                    assert way == ("tensorwise" if Tuning().fp8_one_token_tensorwise else "w8a16"), way
                if scheme.weights == "channel" and scheme.activations == "token":
                    # the tensorwise GEMM at any M, the tokens' scales after it: W8A8's product
                    for dt in (torch.float32, torch.bfloat16):
                        out.append((f"Fp8Linear channel/token M={M} tensorwise, {dt} before the scales",
                                    _rel(lin.w8a8_tensorwise(x, dt).float(), lin.reference(x).float()), 1e-2))
                    # and the engine's way to it: above W8A16's rows, up to fp8_tensorwise_max_m
                    with _tuned(lin, fp8_tensorwise_max_m=64):
                        want = ("tensorwise" if M == 1 or small < M <= 64 else "w8a16" if M <= small else "w8a8")
                        assert lin.way(x) == want, (M, lin.way(x))
                        assert lin.takes_fp8(x) == (want in ("tensorwise", "w8a8"))
                        out.append((f"Fp8Linear channel/token M={M} {want} with fp8_tensorwise_max_m 64",
                                    _rel(lin(x).float(), lin.reference(x, quantize_activations=want != "w8a16").float()),
                                    1e-2))
                if way in ("tensorwise", "w8a8") and scheme.weights != "block":
                    # cuBLASLt's sums kept in the tensor cores' accumulator (Tuning.fp8_fast_accum,
                    # the default) or promoted to float32: the same product either way
                    for fast in (True, False):
                        with _tuned(lin, fp8_fast_accum=fast):
                            out.append((f"Fp8Linear {scheme.weights}/{scheme.activations} M={M} {way}, "
                                        f"{'fast' if fast else 'promoted'} accumulation",
                                        _rel(lin(x).float(), lin.reference(x).float()), 1e-2))
                if lin.takes_fp8(x):   # the input quantized by the kernel before: the same product
                    out.append((f"Fp8Linear {scheme.weights}/{scheme.activations} M={M} {way} from Fp8Acts",
                                _rel(lin(fp8.Fp8Acts(*triton_fp8.quantize_tokens(x))).float(), lin(x).float()), 0.0))
            picked = triton_w8a16.KERNEL["block" if scheme.weights == "block" else "row"]
            for M in (1, 5, 16):   # the W8A16 kernel `KERNEL` does not pick for these scales
                x = rnd(M, 256, dt=torch.bfloat16)
                other = "swap_ab" if picked == "ab" else "ab"
                out.append((f"Fp8Linear {scheme.weights}/{scheme.activations} M={M} W8A16 {other}",
                            _rel(lin.w8a16(x, kernel=other).float(),
                                 lin.reference(x, quantize_activations=False).float()), 1e-2))
    K_ = load_kernels()
    # quantize=True: RMSNorm (alone, after the residual add) and SiLU·mul write their output
    # as FP8 per token in their own launch: exactly quantize_tokens of their plain output
    for T, H in [(1, 256), (5, 4096)]:
        x, r, w = rnd(T, H, dt=adt), rnd(T, H, dt=adt), rnd(H, dt=adt)
        for name, args in (("rms_norm", (x, w, 1e-5)), ("fused_add_rms_norm", (x, r, w, 1e-5)),
                           ("silu_and_mul", (torch.cat([x, r], -1),))):
            plain, fused = K_[name](*args), K_[name](*args, True)
            if name == "fused_add_rms_norm":
                assert torch.equal(plain[1], fused[1])   # the new residual as before
                plain, fused = plain[0], fused[0]
            rq, rs = triton_fp8.quantize_tokens(plain)
            out.append((f"{name} quantize=True T={T} H={H}",
                        max(_rel(fused.scale, rs), _rel(fused.q.float(), rq.float())), 0.0))
    # KV cache: FP8 pages with per-tensor scales
    ks, vs = 0.02, 0.03
    hk, d, ps, pages = 2, 64, 8, 24
    kc = torch.zeros(pages, ps, hk, d, dtype=torch.float8_e4m3fn, device=device)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    k, v = rnd(20, hk, d, dt=adt), rnd(20, hk, d, dt=adt)
    slots = (ps + torch.randperm((pages - 1) * ps, generator=g)[:20]).to(device)
    K_["write_kv"](k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    ops.write_kv_reference(k, v, kr, vr, slots, k_scale=ks, v_scale=vs)
    out.append(("write_kv fp8", max(_rel(kc.float() * ks, kr.float() * ks), _rel(vc.float() * vs, vr.float() * vs)),
                qtol))
    # the same pages through the fused RoPE and write: its cache bytes equal write_kv's of the rotated k
    q = rnd(20, 4, d, dt=adt)
    pos = torch.randint(0, 64, (20,), generator=g).to(device)
    cos_sin = rnd(64, d, dt=adt)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    qo, ko = K_["rope_write_kv"](q, k, v, pos, cos_sin, kc2, vc2, slots, k_scale=ks, v_scale=vs)
    kr2, vr2 = torch.zeros_like(kc), torch.zeros_like(vc)
    K_["write_kv"](K_["apply_rope"](q, k, pos, cos_sin)[1], v, kr2, vr2, slots, k_scale=ks, v_scale=vs)
    out.append(("rope_write_kv fp8", 0.0 if (torch.equal(kc2.view(torch.uint8), kr2.view(torch.uint8))
                                             and torch.equal(vc2.view(torch.uint8), vr2.view(torch.uint8))) else 1.0,
                0.0))
    kc = (rnd(pages, ps, hk, d) / ks).clamp(-448, 448).to(torch.float8_e4m3fn)
    vc = (rnd(pages, ps, hk, d) / vs).clamp(-448, 448).to(torch.float8_e4m3fn)
    bt = torch.randperm(pages - 1, generator=g)[:20].add(1).view(2, 10).int().to(device)
    for extra in ({}, {"window": 9}):
        q = rnd(2, 8, d, dt=adt)
        cl = torch.tensor([50, 77], dtype=torch.int32, device=device)
        o = K_["decode_attention"](q, kc, vc, bt, cl, d ** -0.5, k_scale=ks, v_scale=vs, **extra)
        r = ops.decode_attention_reference(q.float(), kc, vc, bt, cl, d ** -0.5, k_scale=ks, v_scale=vs, **extra)
        out.append((f"decode_attention fp8 kv {extra}", _rel(o.float(), r), 1e-2))
        ql = [7, 30]
        cu = torch.tensor([0, 7, 37], dtype=torch.int32, device=device)
        q = rnd(37, 8, d, dt=adt)
        o = K_["prefill_attention"](q, kc, vc, bt, cu, cl, d ** -0.5, k_scale=ks, v_scale=vs, **extra)
        r = ops.prefill_attention_reference(q.float(), kc, vc, bt, cu, cl, d ** -0.5, k_scale=ks, v_scale=vs, **extra)
        out.append((f"prefill_attention fp8 kv q={ql} {extra}", _rel(o.float(), r), 1e-2))
    return out


SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter, report
patch_triton_interpreter()
from test_fp8_kernels import run_checks
res = run_checks(torch.device("cpu"))
print(report(res))
print("RESULT", "ok" if all(e <= t for _, e, t in res) else "bad")
"""


def test_fp8_kernels_in_interpreter():
    run_in_interpreter(SCRIPT)


@pytest.mark.gpu
def test_fp8_kernels_on_gpu():
    res = run_checks(torch.device("cuda"))
    assert all(e <= t for _, e, t in res), report(res)
