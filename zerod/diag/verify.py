"""References computed another way, so that a fast wrong answer fails.

- A GEMM's product is checked whole by Freivalds' method: C·X against A·(B·X) in
  fp32 matrix-vector products (other kernels than the tensor-core GEMM), with a
  tolerance from bf16's rounding of C; and one tile against float64 on the CPU.
- A copy is checked against the pattern it was filled with, regenerated.
Works on any device, so the CPU tests exercise the same code.
"""

from __future__ import annotations

import contextlib
import math

BF16_UNIT_ROUNDOFF = 2.0 ** -8
SIGMAS = 8.0  # how far past bf16's rounding noise a residual must be to count as wrong
TILE = 64


# FP8 tensor cores accumulate with fewer bits than fp32 between promotions: an allowance
# on top of the output's bf16 rounding, per element, relative
FP8_ACCUMULATION_REL = 2.0 ** -9


@contextlib.contextmanager
def _reference_matmuls_in_fp32(torch):
    """fp32 products stay fp32 (no TF32) while a reference is computed."""
    m = torch.backends.cuda.matmul
    saved = m.allow_tf32
    m.allow_tf32 = False
    try:
        yield
    finally:
        m.allow_tf32 = saved


def gemm_residual(torch, a, b, c, vectors: int = 4, seed: int = 0, extra_rel: float = 0.0) -> float:
    """The worst row's |C·X - A·(B·X)| over its rounding-noise bound (> 1: wrong).

    `a` is M×K, `b` K×N (any dtype torch can upcast), `c` the M×N product to judge;
    `extra_rel` widens each element's allowance (FP8_ACCUMULATION_REL for FP8 products)."""
    g = torch.Generator(device=c.device).manual_seed(seed)
    x = torch.randn(c.shape[1], vectors, device=c.device, dtype=torch.float32, generator=g)
    with _reference_matmuls_in_fp32(torch):
        cf = c.float()
        got = cf @ x
        want = a.float() @ (b.float() @ x)
        # rounding C to bf16 moves each element by up to u·|c| (rms u/√3·|c|): the residual's spread
        per_element = math.sqrt(BF16_UNIT_ROUNDOFF ** 2 / 3.0 + extra_rel ** 2)
        noise = per_element * torch.sqrt((cf * cf) @ (x * x))
    floor = 1e-6 * (want.abs() + 1.0)  # fp32 accumulation over K in the reference itself
    return float(((got - want).abs() / (SIGMAS * noise + floor)).max().item())


def gemm_tile_error(torch, a, b, c, extra_rel: float = 0.0) -> float:
    """The first TILE×TILE block of C against float64 on the CPU: the worst element's
    error over bf16's rounding bound (> 1: wrong)."""
    t = min(TILE, c.shape[0], c.shape[1])
    ref = a[:t].float().cpu().double() @ b[:, :t].float().cpu().double()  # float8 upcasts through float32
    got = c[:t, :t].float().cpu().double()
    bound = (2 * BF16_UNIT_ROUNDOFF + 4 * extra_rel) * ref.abs() + 1e-3 * float(ref.abs().mean()) + 1e-6
    return float(((got - ref).abs() / bound).max().item())


STEP = 1 << 24  # elements per slice: the index temporaries stay at 128 MiB however large the buffer


def fill_pattern(torch, buf, seed: int) -> None:
    """Fill a 1-D int32 buffer with a value derived from each element's index and the
    seed (a multiplicative hash: neighbours differ in many bits, no two buffers alike)."""
    for start in range(0, buf.numel(), STEP):
        part = buf[start:start + STEP]
        part.copy_(_pattern(torch, start, part.numel(), seed, buf.device))


def pattern_mismatches(torch, buf, seed: int) -> int:
    """How many elements of a 1-D int32 buffer differ from fill_pattern(seed), regenerated."""
    bad = 0
    for start in range(0, buf.numel(), STEP):
        part = buf[start:start + STEP]
        bad += int((part != _pattern(torch, start, part.numel(), seed, buf.device)).sum().item())
    return bad


def _pattern(torch, start: int, n: int, seed: int, device):
    idx = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return ((idx * 2654435761 + seed * 40503) & 0x7FFFFFFF).to(torch.int32)
