"""Check each kernel against a torch reference on fresh random inputs.

A test harness, not part of the package: used by tests/test_kernels_*.py (on the GPU,
and on the CPU through Triton's interpreter) and by gpu/kernels_bench.py and
gpu/kernels_memcheck.py (which put tests/ on sys.path) before anything is timed.

For every case: fresh random inputs (never zeros), the reference computed in
float32 from the same inputs, ||out - ref|| / ||ref|| in float64, no NaN/Inf,
and every output element written: on CUDA, freshly allocated outputs land on
memory that was filled with NaN just before (the caching allocator hands the
freed block back), so an element the kernel skipped shows up as NaN. For
write_kv the cache is random and every slot not written must keep its value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from zerod.engine.kernels import reference as _ref

TOL_BF16 = 1e-2  # bf16 operands: 1e-3 .. 1e-2 is the usual relative error (docs/perf.md)
TOL_F32 = 1e-4


@dataclasses.dataclass
class CaseResult:
    kernel: str
    case: str
    rel_err: float
    max_abs: float
    all_written: bool
    tol: float

    @property
    def ok(self) -> bool:
        return self.all_written and math.isfinite(self.rel_err) and self.rel_err <= self.tol

    def line(self) -> str:
        return (f"{'PASS' if self.ok else 'FAIL'} {self.kernel:20s} {self.case:48s} "
                f"rel={self.rel_err:.2e} max_abs={self.max_abs:.2e} written={self.all_written}")


def _poison(device: torch.device, nbytes: int = 64 << 20) -> None:
    """Fill soon-to-be-reused allocator memory with NaN (CUDA caching allocator)."""
    if device.type == "cuda":
        t = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        t.fill_(float("nan"))
        del t


def _rel(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, bool]:
    o = out.double()
    r = ref.double()
    finite = bool(torch.isfinite(o).all())
    diff = o - r
    denom = r.norm().item()
    rel = diff.norm().item() / (denom if denom > 0 else 1.0)
    return rel, diff.abs().max().item() if diff.numel() else 0.0, finite


def _f32(*ts):
    return [t.float() if t.is_floating_point() else t for t in ts]


def _tol(dtype: torch.dtype) -> float:
    return TOL_F32 if dtype == torch.float32 else TOL_BF16


def paged_kv(ctx_lens: list[int], page_size: int, hk: int, d: int, dtype, device,
             extra_pages: int = 3, width: int | None = None, gen: torch.Generator | None = None):
    """Random K/V pool with each sequence's pages scattered in random order."""
    need = [(n + page_size - 1) // page_size for n in ctx_lens]
    num_pages = sum(need) + extra_pages
    k_cache = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    v_cache = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = width or max(max(need), 1)
    bt = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    cl = torch.tensor(ctx_lens, dtype=torch.int32)
    return k_cache, v_cache, bt.to(device), cl.to(device)


def _randn(*shape, dtype, device, gen):
    """Random normal drawn on the CPU (one generator for every device), then moved."""
    return torch.randn(*shape, dtype=torch.float32, generator=gen).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------- cases

def check_rms_norm(fn, ref, T, H, dtype, device, gen, fused=False):
    x = _randn(T, H, dtype=dtype, device=device, gen=gen)
    w = (1 + 0.1 * _randn(H, dtype=torch.float32, device=device, gen=gen)).to(dtype)
    eps = 1e-5
    if fused:
        r = _randn(T, H, dtype=dtype, device=device, gen=gen)
        _poison(device)
        out, res = fn(x, r, w, eps)
        # reference from the same rounding of x + r (bf16 add), in float32 after
        new_res = (x.float() + r.float()).to(dtype)
        ref_out = ref["rms_norm"](new_res.float(), w.float(), eps)
        rel1, mx1, f1 = _rel(out, ref_out)
        rel2, mx2, f2 = _rel(res, new_res)
        return CaseResult("fused_add_rms_norm", f"T={T} H={H} {str(dtype)[6:]}",
                          max(rel1, rel2), max(mx1, mx2), f1 and f2, _tol(dtype))
    _poison(device)
    out = fn(x, w, eps)
    rel, mx, fin = _rel(out, ref["rms_norm"](x.float(), w.float(), eps))
    return CaseResult("rms_norm", f"T={T} H={H} {str(dtype)[6:]}", rel, mx, fin, _tol(dtype))


def check_rope(fn, ref, T, hq, hk, d, dtype, device, gen, max_pos=8192, cache_dtype=torch.float32,
               strided=True):
    if strided:  # views of a fused qkv projection output, as the model has them
        qkv = _randn(T, (hq + 2 * hk) * d, dtype=dtype, device=device, gen=gen)
        q = qkv[:, : hq * d].view(T, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(T, hk, d)
    else:
        q = _randn(T, hq, d, dtype=dtype, device=device, gen=gen)
        k = _randn(T, hk, d, dtype=dtype, device=device, gen=gen)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(device)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    ang = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(cache_dtype)
    _poison(device)
    qo, ko = fn(q, k, pos, cache)
    rq, rk = ref["apply_rope"](*_f32(q, k), pos, cache.float())
    r1, m1, f1 = _rel(qo, rq)
    r2, m2, f2 = _rel(ko, rk)
    return CaseResult("apply_rope", f"T={T} Hq={hq} Hk={hk} D={d} strided={strided}",
                      max(r1, r2), max(m1, m2), f1 and f2, _tol(dtype))


def check_silu(fn, ref, T, inter, dtype, device, gen):
    x = _randn(T, 2 * inter, dtype=dtype, device=device, gen=gen)
    _poison(device)
    out = fn(x)
    rel, mx, fin = _rel(out, ref["silu_and_mul"](x.float()))
    return CaseResult("silu_and_mul", f"T={T} I={inter} {str(dtype)[6:]}", rel, mx, fin, _tol(dtype))


def check_write_kv(fn, ref, T, hk, d, page_size, dtype, device, gen, pad=2):
    num_pages = (T + pad) // page_size + 4
    kc = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    vc = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    k = _randn(T, hk, d, dtype=dtype, device=device, gen=gen)
    v = _randn(T, hk, d, dtype=dtype, device=device, gen=gen)
    # page 0 is the scratch page (docs/engine-interface.md): padded rows of a captured
    # bucket write there; real tokens go to distinct random slots of the other pages
    slots = page_size + torch.randperm((num_pages - 1) * page_size, generator=gen)[:T]
    slots[:min(pad, T)] = torch.arange(min(pad, T))
    slots = slots.to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref["write_kv"](k, v, kc_ref, vc_ref, slots)
    fn(k, v, kc, vc, slots)
    r1, m1, f1 = _rel(kc, kc_ref)
    r2, m2, f2 = _rel(vc, vc_ref)
    exact = bool(torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref))
    return CaseResult("write_kv", f"T={T} Hk={hk} D={d} page={page_size} pad={pad}",
                      max(r1, r2), max(m1, m2), f1 and f2 and exact, 0.0)


def check_rope_write_kv(fn, ref, T, hq, hk, d, page_size, dtype, device, gen, pad=2):
    """The fused op against the references of its two halves: q and k rotated within
    tolerance, the cache bitwise what write_kv of the kernel's own rotated k puts there
    (every slot not written keeps its value; padded rows write into the scratch page 0)."""
    qkv = _randn(T, (hq + 2 * hk) * d, dtype=dtype, device=device, gen=gen)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d:].view(T, hk, d)
    max_pos = 4096
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(device)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    ang = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).to(dtype)
    num_pages = (T + pad) // page_size + 4
    kc = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    vc = _randn(num_pages, page_size, hk, d, dtype=dtype, device=device, gen=gen)
    slots = page_size + torch.randperm((num_pages - 1) * page_size, generator=gen)[:T]
    slots[:min(pad, T)] = torch.arange(min(pad, T))
    slots = slots.to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    _poison(device)
    qo, ko = fn(q, k, v, pos, cache, kc, vc, slots)
    rq, rk = ref["apply_rope"](*_f32(q, k), pos, cache.float())
    ref["write_kv"](ko, v, kc_ref, vc_ref, slots)
    r1, m1, f1 = _rel(qo, rq)
    r2, m2, f2 = _rel(ko, rk)
    exact = bool(torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref))
    return CaseResult("rope_write_kv", f"T={T} Hq={hq} Hk={hk} D={d} page={page_size} pad={pad}",
                      max(r1, r2), max(m1, m2), f1 and f2 and exact, _tol(dtype))


def check_decode(fn, ref, ctx_lens, hq, hk, d, page_size, dtype, device, gen, width=None, **kw):
    B = len(ctx_lens)
    kc, vc, bt, cl = paged_kv(ctx_lens, page_size, hk, d, dtype, device, width=width, gen=gen)
    q = _randn(B, hq, d, dtype=dtype, device=device, gen=gen)
    scale = d ** -0.5
    _poison(device)
    attn = {k: kw.pop(k) for k in ("window", "softcap") if k in kw}   # the op's own arguments
    out = fn(q, kc, vc, bt, cl, scale, **attn, **kw)
    r = ref["decode_attention"](*_f32(q, kc, vc), bt, cl, scale, **attn)
    kw.update(attn)
    # a row of context 0 (one forward a step: a chunk's or padding row in the decode
    # kernel's tail) has no reference; it must come out finite, the live rows right
    live = torch.tensor([n > 0 for n in ctx_lens], device=out.device)
    rel, mx, fin = _rel(out[live], r[live])
    fin = fin and bool(torch.isfinite(out.double()).all())
    lens = ctx_lens if len(ctx_lens) <= 4 else f"{min(ctx_lens)}..{max(ctx_lens)}"
    extra = " ".join(f"{k}={v}" for k, v in kw.items())
    return CaseResult("decode_attention", f"B={B} ctx={lens} Hq={hq} Hk={hk} D={d} {extra}".strip(),
                      rel, mx, fin, _tol(dtype))


def check_prefill(fn, ref, q_lens, ctx_lens, hq, hk, d, page_size, dtype, device, gen, **kw):
    kc, vc, bt, cl = paged_kv(ctx_lens, page_size, hk, d, dtype, device, gen=gen)
    T = sum(q_lens)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    q = _randn(T, hq, d, dtype=dtype, device=device, gen=gen)
    scale = d ** -0.5
    _poison(device)
    attn = {k: kw.pop(k) for k in ("window", "softcap") if k in kw}   # the op's own arguments
    out = fn(q, kc, vc, bt, cu, cl, scale, **attn, **kw)
    r = ref["prefill_attention"](*_f32(q, kc, vc), bt, cu, cl, scale, **attn)
    rel, mx, fin = _rel(out, r)
    ql = q_lens if len(q_lens) <= 4 else f"{min(q_lens)}..{max(q_lens)}"
    cl_ = ctx_lens if len(ctx_lens) <= 4 else f"{min(ctx_lens)}..{max(ctx_lens)}"
    extra = " ".join(f"{k}={v}" for k, v in {**attn, **kw}.items())
    return CaseResult("prefill_attention", f"q={ql} ctx={cl_} Hq={hq} Hk={hk} D={d} {extra}".strip(),
                      rel, mx, fin, _tol(dtype))


def all_cases(device: torch.device, big: bool) -> list[tuple[str, Callable]]:
    """(name, thunk(kernels, ref, gen) -> CaseResult); big=True adds the 8B-sized ones."""
    bf = torch.bfloat16
    dev = device
    # Triton's CPU interpreter computes tl.dot on bf16 operands wrongly (raw bits; seen
    # with triton 3.6), so on the CPU the attention kernels are checked in fp16.
    adt = bf if device.type == "cuda" else torch.float16
    c: list[tuple[str, Callable]] = []

    def add(name, f):
        c.append((name, f))

    for T, H, dt in [(1, 4096, bf), (7, 1000, bf), (33, 4096, torch.float16), (5, 256, torch.float32)]:
        add("rms_norm", lambda K, R, g, T=T, H=H, dt=dt: check_rms_norm(K["rms_norm"], R, T, H, dt, dev, g))
        add("fused_add_rms_norm", lambda K, R, g, T=T, H=H, dt=dt:
            check_rms_norm(K["fused_add_rms_norm"], R, T, H, dt, dev, g, fused=True))
    for T, hq, hk, d, strided, cdt in [(1, 32, 8, 128, True, torch.float32), (37, 32, 8, 128, True, bf),
                                       (5, 4, 2, 64, False, torch.float32), (9, 14, 2, 64, True, torch.float32)]:
        add("apply_rope", lambda K, R, g, T=T, hq=hq, hk=hk, d=d, s=strided, cdt=cdt:
            check_rope(K["apply_rope"], R, T, hq, hk, d, bf, dev, g, cache_dtype=cdt, strided=s))
    for T, inter in [(1, 14336), (13, 1000), (4, 64)]:
        add("silu_and_mul", lambda K, R, g, T=T, i=inter: check_silu(K["silu_and_mul"], R, T, i, bf, dev, g))
    for T, hk, d, ps in [(1, 8, 128, 16), (50, 8, 128, 16), (7, 2, 64, 8)]:
        add("write_kv", lambda K, R, g, T=T, hk=hk, d=d, ps=ps:
            check_write_kv(K["write_kv"], R, T, hk, d, ps, bf, dev, g, pad=min(2, T - 1)))
    for T, hq, hk, d, ps in [(1, 32, 8, 128, 16), (50, 32, 8, 128, 16), (7, 14, 2, 64, 8)]:
        add("rope_write_kv", lambda K, R, g, T=T, hq=hq, hk=hk, d=d, ps=ps:
            check_rope_write_kv(K["rope_write_kv"], R, T, hq, hk, d, ps, bf, dev, g, pad=min(2, T - 1)))

    dec = [
        ([1], 32, 8, 128, 16, {}),
        ([1, 17, 33], 32, 8, 128, 16, {}),                 # ragged, crossing pages
        ([16, 15, 48, 200], 32, 8, 128, 16, {"num_splits": 1}),
        ([16, 15, 48, 200], 32, 8, 128, 16, {"num_splits": 4}),
        ([300, 5, 129], 14, 2, 64, 16, {"num_splits": 8}),  # group 7 (Qwen2-like), tiny splits
        ([100, 64], 8, 8, 64, 8, {}),                       # no GQA, page 8
        ([513], 32, 8, 128, 16, {"num_splits": 2, "block_n": 32}),
        # sliding window (Mistral, Gemma local layers) and soft-capping (Gemma 2)
        ([1, 17, 200, 513], 32, 8, 128, 16, {"window": 64}),
        ([300, 5, 129], 14, 2, 64, 16, {"num_splits": 8, "window": 100, "softcap": 1.5}),
        ([40, 3], 8, 8, 64, 8, {"softcap": 1.5}),
    ]
    if big:
        g0 = torch.Generator().manual_seed(1)
        dec += [
            (torch.randint(1, 400, (200,), generator=g0).tolist(), 32, 8, 128, 16, {}),
            ([1024] * 4, 32, 8, 128, 16, {}),
            ([16384], 32, 8, 128, 16, {}),
            ([16384, 7], 32, 8, 128, 16, {"num_splits": 64}),
        ]
    for lens, hq, hk, d, ps, kw in dec:
        add("decode_attention", lambda K, R, g, lens=lens, hq=hq, hk=hk, d=d, ps=ps, kw=kw:
            check_decode(K["decode_attention"], R, lens, hq, hk, d, ps, adt, dev, g, **kw))
    # one forward a step's tail: rows of context 0 among the decodes, with and without splits
    add("decode_attention", lambda K, R, g: check_decode(
        K["decode_attention"], R, [0, 17, 0, 0, 200], 32, 8, 128, 16, adt, dev, g, width=16))
    add("decode_attention", lambda K, R, g: check_decode(
        K["decode_attention"], R, [0, 300, 0], 14, 2, 64, 16, adt, dev, g, num_splits=8))
    # graph-capture style: the table is as wide as the captured bucket's (max model len)
    add("decode_attention", lambda K, R, g: check_decode(
        K["decode_attention"], R, [3, 40], 32, 8, 128, 16, adt, dev, g, width=64))

    pre = [
        ([37], [37], 32, 8, 128, 16),
        ([5, 64, 130], [5, 100, 300], 32, 8, 128, 16),   # cached prefixes, ragged
        ([3, 0, 20], [3, 9, 52], 14, 2, 64, 16),         # a sequence with no new tokens
        ([1, 1], [77, 1], 8, 8, 64, 8),
        ([37, 130], [37, 300], 32, 8, 128, 16, {"window": 50}),   # window inside a cached prefix
        ([5, 64, 1], [5, 100, 9], 14, 2, 64, 16, {"window": 7, "softcap": 1.5}),
        ([70], [70], 8, 8, 64, 8, {"softcap": 1.5}),
    ]
    if big:
        pre += [
            ([2048], [8192], 32, 8, 128, 16),            # a chunk after a 6K cached prefix
            ([1000, 24, 700], [1000, 24, 1500], 32, 8, 128, 16),
        ]
    for ql, cl, hq, hk, d, ps, *kw in pre:
        add("prefill_attention", lambda K, R, g, ql=ql, cl=cl, hq=hq, hk=hk, d=d, ps=ps, kw=kw:
            check_prefill(K["prefill_attention"], R, ql, cl, hq, hk, d, ps, adt, dev, g, **dict(*kw)))
    return c


def run_all(kernels: dict, device, big: bool = False, ref: dict | None = None, seed: int = 0,
            only: set | None = None) -> list[CaseResult]:
    ref = ref or _ref.REFERENCES
    gen = torch.Generator().manual_seed(seed)
    results = []
    for name, thunk in all_cases(device, big):
        if only and name not in only:
            continue
        results.append(thunk(kernels, ref, gen))
    return results


def report(res: list[tuple[str, float, float]]) -> str:
    """(name, error, tolerance) checks, one line each, BAD where the error is over."""
    return "\n".join(f"{'ok ' if e <= t else 'BAD'} {name}: {e:.2e} (tol {t:.0e})" for name, e, t in res)


def run_in_interpreter(script: str, *args: str) -> None:
    """Run `script` (python -c) with Triton's CPU interpreter on, the repository and tests/
    importable and no GPU visible; it must print "RESULT ok" (its own checks decide)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert "RESULT ok" in p.stdout, p.stdout + p.stderr[-4000:]


def patch_triton_interpreter() -> None:
    """Make Triton's CPU interpreter (TRITON_INTERPRET=1) accept scalar loads as loop bounds.

    The interpreter holds a loaded scalar as a 1-element array, and with numpy >= 2
    `int()` of such an array raises, so `range(start, end)` over loaded lengths
    fails there (it compiles fine for the GPU). Only the CPU tests use this.
    """
    from triton.runtime import interpreter as _it

    if getattr(_it, "_zerod_patched", False):
        return
    orig = _it._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _it._patch_lang_tensor = patched
    _it._zerod_patched = True
