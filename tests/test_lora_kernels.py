"""The LoRA shrink/expand kernels (engine/kernels/lora.py) against the torch reference:
on the CPU through Triton's interpreter, and on a CUDA GPU (bf16, fp16, fp32), where the
engine also runs adapters through its decode CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import run_in_interpreter
from zerod.engine.model.linear import Linear
from zerod.engine.lora.delta import lora_reference
from zerod.engine.lora.slabs import LoraBatch, LoraProjection


# (rows, segments of the output, max rank, slots incl. 0, every row in slot 1): decode-sized
# batches (up to FUSED_MAX_ROWS rows, the DECODE ways) with base rows mixed in, and larger
# ones (shrink + expand): fused qkv (GQA) and gate_up, a plain projection, ranks 16, 8 and
# one below the tile, more rows of one slot than a tile holds
CASES = [(1, (64, 32, 32), 16, 5, True), (7, (48,), 8, 3, False), (16, (96, 96), 16, 3, True),
         (12, (64, 32, 32), 8, 4, False), (9, (96, 96), 8, 5, False), (16, (48,), 16, 4, False),
         (40, (96, 96), 16, 9, False), (300, (64, 32, 32), 16, 4, False), (33, (80,), 4, 2, False)]


def check_grouping(groups, idx: torch.Tensor, S: int) -> list[str]:
    """Failures of group_rows' output against a stable sort of the rows by slot."""
    idx = idx.cpu().tolist()
    T, bm = len(idx), groups.block_m
    counts = [idx.count(s) for s in range(S)]
    want_tiles = [(s, m0) for s in range(1, S) for m0 in range(0, counts[s], bm)]
    tiles = list(zip(*groups.tiles.cpu().tolist()))
    bad = []
    if groups.order.cpu().tolist() != sorted(range(T), key=lambda t: (idx[t], t)):
        bad.append(f"T={T}: order is not the stable sort by slot")
    if groups.counts.cpu().tolist() != counts or groups.starts.cpu().tolist() != [sum(counts[:s]) for s in range(S)]:
        bad.append(f"T={T}: counts / starts")
    if tiles[:len(want_tiles)] != want_tiles or any(s for s, _ in tiles[len(want_tiles):]):
        bad.append(f"T={T}: tiles {tiles} != {want_tiles} then slot 0")
    return bad


def check_kernels(device: str, dtype: torch.dtype, tol: float) -> list[str]:
    """Failures (empty: all match) of the kernels vs the reference over CASES, through
    add_lora (the way a forward takes) and every other way for the same rows."""
    from zerod.engine.kernels.lora import DECODE, FUSED_MAX_ROWS, add_lora, lora_expand_slots, lora_splitk

    def splitk3(y, x, A, B, segs, g):   # K = 72 in three chunks of 32, 32 and 8
        lora_splitk(y, x, A, B, segs, g, splits=3)

    def expand_slots(y, x, A, B, segs, g):   # what a product carrying the A rows leaves
        lora_expand_slots(y, x @ A.reshape(-1, A.shape[2]).T, B, segs, g)

    g = torch.Generator().manual_seed(1)
    bad = []
    for T, segs, R, S, one_slot in CASES:
        ways = {"add_lora": add_lora, "two-launch": DECODE["two-launch"],
                "expand from every slot's shrink": expand_slots}
        if T <= FUSED_MAX_ROWS:
            ways.update(DECODE, **{"splitk-atomic x3": splitk3})
        n_in = 72
        A = torch.randn(S, len(segs) * R, n_in, generator=g) * 0.2
        B = torch.randn(S, sum(segs), R, generator=g) * 0.2
        A[0].zero_()
        B[0].zero_()
        x = torch.randn(T, n_in, generator=g)
        y = torch.randn(T, sum(segs), generator=g)
        idx = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
        if one_slot:
            idx[:] = 1
        else:
            idx[0] = 0     # a base row among adapter rows
        A, B, x, y, idx = (t.to(device) for t in (A, B, x, y, idx))
        A, B, x, y = (t.to(dtype) for t in (A, B, x, y))
        want = lora_reference(y.clone(), x, A, B, segs, idx).float()
        batch = LoraBatch(S)
        batch.set(idx, grouped=True)
        bad += check_grouping(batch.groups, idx, S)
        base = idx == 0
        # the projections a forward calls: a quantized one's (its own shrink, on CUDA beside
        # the product) and a plain one's (the shrink in the product, its weight carrying A)
        proj = LoraProjection(segs, n_in, R, batch, dtype, torch.device(device))
        proj.A, proj.B = A, B
        ways["LoraProjection"] = lambda got, x, A, B, segs, groups: got.copy_(proj(x, lambda _: got.clone()))
        lin = Linear(sum(segs), n_in, bias=False, dtype=dtype, device=device)
        lin.weight.zero_()   # the base product adds nothing: got = y + the delta
        lin.lora = LoraProjection(segs, n_in, R, batch, dtype, torch.device(device), lin)
        lin.lora.A.copy_(A)
        lin.lora.B.copy_(B)
        assert lin.lora.weight is not None and lin.weight.data_ptr() == lin.lora.weight.data_ptr()
        ways["LoraProjection, A in the weight"] = lambda got, x, A, B, segs, groups: got.add_(lin(x))
        for way, fn in ways.items():
            got = y.clone()
            fn(got, x, A, B, segs, batch.groups)
            err = (got.float() - want).abs().max().item()
            case = f"{way} T={T} segs={segs} R={R} S={S} {dtype}"
            if err > tol * (1 + want.abs().max().item()):
                bad.append(f"{case}: max error {err:.3g}")
            elif not torch.equal(got[base], y[base]):
                bad.append(f"{case}: a base row changed")
    return bad


SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter
patch_triton_interpreter()
from test_lora_kernels import check_kernels
bad = check_kernels("cpu", torch.float32, 1e-4) + check_kernels("cpu", torch.float16, 2e-2)
print("\n".join(bad))
print("RESULT", "bad" if bad else "ok")
"""


def test_kernels_in_interpreter():
    pytest.importorskip("triton")
    run_in_interpreter(SCRIPT)


def test_splitk_fills_the_gpu_with_short_programs_at_8b_shapes():
    """A batch-1 decode's products at the 8B shape (qkv, o, gate_up, down) get ~100+
    programs each, none walking more than MAX_CHUNK of K nor split below MIN_CHUNK; with
    9 row tiles (16 rows over 8 adapters) the splits shrink instead of multiplying."""
    pytest.importorskip("triton")
    import triton

    from zerod.engine.kernels.lora import MAX_CHUNK, MIN_CHUNK, TARGET_PROGRAMS, splitk_splits

    for K, N in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        cols = triton.cdiv(N, 256)
        for nt in (1, 9):
            s = splitk_splits(K, nt * cols)
            chunk = triton.cdiv(K, s)
            assert chunk <= MAX_CHUNK and (s == 1 or chunk >= MIN_CHUNK), (K, N, nt, s)
            assert nt * cols * s <= 2 * TARGET_PROGRAMS or chunk == MAX_CHUNK, (K, N, nt, s)
            if nt == 1:
                assert nt * cols * s >= TARGET_PROGRAMS // 2, (K, N, s)


# ---------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3),
                                       (torch.float32, 1e-5)])
def test_kernels_match_reference_on_cuda(dtype, tol):
    from zerod.engine.kernels import CUDA_KERNELS

    if not CUDA_KERNELS:
        pytest.skip("no Triton kernels on this GPU")
    assert check_kernels("cuda", dtype, tol) == []


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The tiny base checkpoint, its PEFT adapters and the reference models (fp32, CPU):
    the base and each adapter merged by PEFT."""
    from families_support import prompts
    from lora_support import base_and_adapters

    base, paths, refs = base_and_adapters(tmp_path_factory.mktemp("lora-gpu"))
    return base, paths, prompts(300)[:4], refs


@pytest.mark.gpu
def test_engine_on_cuda_serves_adapters_through_graphs(adapters):
    """fp32 on the GPU, adapters and base rows mixed in one batch through the LoRA prefill
    and decode graphs: every row's logprobs are its model's (PEFT's merged model, or the base) run
    over the same tokens; loading another adapter recaptures nothing; a decode step with
    adapters has no host sync. Logprobs rather than tokens: the attention kernels' dots
    run TF32 on fp32, and this random tiny model has near-ties (0.0015 apart in logit)
    that may go either way."""
    from lora_support import generate, logprob_errors
    from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams

    base, paths, ps, refs = adapters
    names = list(paths)
    eng = Engine(EngineConfig(model=str(base), device="cuda", dtype="float32", kv_pages=256,
                              max_model_len=128, max_num_seqs=32, enable_lora=True, max_loras=2,
                              lora_modules=tuple((n, str(paths[n]), None) for n in names[:2])))
    assert eng.runner.lora_graphs and eng.runner.graphs
    assert eng.runner.lora_pgraphs and eng.runner.pgraphs, "prefill graphs with the LoRA path"
    graphs = dict(eng.runner.lora_graphs)
    padded = []   # (padded tokens, adapter rows) of each prefill through a graph
    run = eng.runner._prefill_padded
    eng.runner._prefill_padded = lambda p, *a: (padded.append((p.padded, p.lora_rows is not None)), run(p, *a))[1]
    eng.start()
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
        jobs = [(p, n) for p in ps for n in names[:2] + [None]]
        got = generate(eng, jobs, sp)
        eng.load_lora(names[2], str(paths[names[2]]))
        jobs2 = [(p, names[2]) for p in ps]
        got += generate(eng, jobs2, sp)
        bad = [f"{n} prompt {ps.index(p)}: {e}" for (p, n), r in zip(jobs + jobs2, got)
               for e in logprob_errors(refs[n], p, r, 2e-2)]
        assert bad == []
        assert eng.runner.lora_graphs == graphs, "loading an adapter recaptured graphs"
        # the waves' prompts (13 tokens of every adapter and the base, then 13 of one) went
        # through the LoRA prefill graphs
        assert padded and all(lora and T in eng.runner.lora_pgraphs for T, lora in padded), padded
        torch.cuda.set_sync_debug_mode("error")
        try:
            # names[2] is resident (just used): writing an adapter's slot is a copy that syncs
            generate(eng, [(ps[0], names[2]), (ps[1], None)], SamplingParams(max_tokens=6, ignore_eos=True))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        eng.shutdown(0)


def test_logprob_check_passes_the_right_model_and_fails_another(adapters):
    """The GPU test's yardstick, on the CPU: the engine's rows agree with their own model
    and not with another (so the check is not vacuous)."""
    from lora_support import generate, logprob_errors
    from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams

    base, paths, ps, refs = adapters
    eng = Engine(EngineConfig(model=str(base), device="cpu", kv_pages=256, max_model_len=128,
                              enable_lora=True, lora_modules=(("all8", str(paths["all8"]), None),)))
    eng.start()
    try:
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
        jobs = [(ps[1], "all8"), (ps[1], None)]
        got = generate(eng, jobs, sp)
    finally:
        eng.shutdown(0)
    assert [logprob_errors(refs[n], p, r, 1e-4) for (p, n), r in zip(jobs, got)] == [[], []]
    assert logprob_errors(refs[None], ps[1], got[0], 2e-2) != []
    assert logprob_errors(refs["mlp16"], ps[1], got[1], 2e-2) != []
