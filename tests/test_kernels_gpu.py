"""The Triton kernels against the torch references, on the GPU (device H200).

Fresh random inputs every case (never zeros), several shapes including ragged
context lengths that cross page boundaries, outputs landing on NaN-poisoned
memory; ||out - ref|| / ||ref|| within bf16 tolerance. References: the engine's
own (`zerod.engine.model.ops` with its kernels turned off) where ops.py is importable,
and this package's independent copy (`kernels/reference.py`) always.
Skipped where CUDA is absent (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _kernels():
    from zerod.engine.kernels import CUDA_KERNELS, IMPORT_ERROR

    if not CUDA_KERNELS:
        pytest.fail(f"CUDA is available but CUDA_KERNELS is empty: {IMPORT_ERROR}")
    return CUDA_KERNELS


def _ops_references():
    """ops.py's torch references (dispatch turned off), or None when ops.py is absent."""
    try:
        from zerod.engine.model import ops
    except Exception:  # noqa: BLE001 - ops.py may not exist yet or may not import
        return None
    from zerod.engine.kernels import KERNEL_NAMES

    def wrap(name):
        fn = getattr(ops, name)

        def call(*a, **kw):
            with ops.kernels_disabled(KERNEL_NAMES):
                return fn(*a, **kw)

        return call

    return {n: wrap(n) for n in KERNEL_NAMES if hasattr(ops, n)}


@pytest.mark.parametrize("big", [False, True], ids=["small", "8b-shapes"])
def test_kernels_match_own_reference(big):
    from kernel_checks import run_all

    res = run_all(_kernels(), torch.device("cuda"), big=big, seed=1234 + big)
    bad = [r.line() for r in res if not r.ok]
    assert not bad, "\n".join(bad)


def test_kernels_match_ops_reference():
    refs = _ops_references()
    if refs is None or len(refs) < 8:
        pytest.skip("engine/model/ops.py not importable here")
    from zerod.engine.kernels import reference
    from kernel_checks import run_all

    full = dict(reference.REFERENCES)
    full.update(refs)
    res = run_all(_kernels(), torch.device("cuda"), big=False, ref=full, seed=99)
    bad = [r.line() for r in res if not r.ok]
    assert not bad, "\n".join(bad)


def test_decode_graph_capture_without_sync():
    """Captured once, replayed with new lengths and queries: right answers, no host sync."""
    from zerod.engine.kernels import reference
    from kernel_checks import paged_kv

    K = _kernels()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    kc, vc, bt, cl = paged_kv([700, 33, 16, 1], 16, 8, 128, torch.bfloat16, dev, width=64, gen=g)
    q = torch.randn(4, 32, 128, generator=g).to(dev, torch.bfloat16)
    scale = 128 ** -0.5
    K["decode_attention"](q, kc, vc, bt, cl, scale)  # compile outside the capture
    torch.cuda.synchronize()
    # host inputs staged in pinned memory beforehand, as the engine's step does:
    # a copy from pageable memory is itself a synchronising call
    lens_h = [torch.tensor(x, dtype=torch.int32).pin_memory() for x in ([700, 33, 16, 1], [5, 1000, 17, 64])]
    q_h = [torch.randn(4, 32, 128, generator=g).to(torch.bfloat16).pin_memory() for _ in lens_h]
    graph = torch.cuda.CUDAGraph()
    try:
        torch.cuda.set_sync_debug_mode("error")
        with torch.cuda.graph(graph):
            out = K["decode_attention"](q, kc, vc, bt, cl, scale)
        for lens, qn in zip(lens_h, q_h):
            torch.cuda.set_sync_debug_mode("error")
            cl.copy_(lens, non_blocking=True)
            q.copy_(qn, non_blocking=True)
            graph.replay()
            torch.cuda.set_sync_debug_mode("default")
            ref = reference.decode_attention(q.float(), kc.float(), vc.float(), bt, cl, scale)
            rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            assert rel < 1e-2, (lens.tolist(), rel)
    finally:
        torch.cuda.set_sync_debug_mode("default")
