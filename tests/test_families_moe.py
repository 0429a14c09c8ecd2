"""Mixtures of experts (Mixtral; Qwen3-MoE with dense layers between the sparse ones):
token-exact with transformers, batched equals alone; the fused Triton kernel equal to the
torch reference in Triton's interpreter (CPU) and on the GPU."""

from __future__ import annotations

import pytest
import torch

from families_support import check_greedy_batched_and_alone, check_logits, hf_checkpoint, reference
from kernel_checks import run_in_interpreter
from zerod.engine.model import ops
from zerod.engine.config import EngineError
from zerod.engine.spec.hf_config import load_model_config, parse_model_config
from zerod.engine.model.moe import fused_experts_reference, route, route_reference
from zerod.engine.spec.weights import weight_bytes

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=6, num_experts_per_tok=2, **COMMON)),
    # layer 0 dense (mlp_only_layers), layer 1 sparse, layer 2 dense (decoder_sparse_step 2)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=1,
                       mlp_only_layers=[0, 2], norm_topk_prob=False, tie_word_embeddings=True, **COMMON)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe_model(request, tmp_path_factory):
    pytest.importorskip("transformers")
    cfg_cls, model_cls, kw = MODELS[request.param]
    d = hf_checkpoint(tmp_path_factory.mktemp(request.param), cfg_cls, model_cls, **kw)
    return request.param, d, *reference(d)


@pytest.mark.slow
def test_config_reads_the_experts(moe_model):
    family, d, m, *_ = moe_model
    mc = load_model_config(d)
    if family == "mixtral":
        assert (mc.num_experts, mc.experts_per_token, mc.moe_intermediate_size, mc.norm_topk_prob) == (6, 2, 96, True)
        assert mc.moe_layers == [True, True, True]
    else:
        assert (mc.num_experts, mc.experts_per_token, mc.moe_intermediate_size, mc.norm_topk_prob) == (8, 3, 32, False)
        assert mc.moe_layers == [False, True, False]
        assert mc.qk_norm
    # the spec's weight bytes (doctor's sizing) count what transformers holds, experts included
    assert weight_bytes(mc, "float32") == 4 * sum(p.numel() for p in m.parameters())


@pytest.mark.slow
def test_greedy_agrees_with_transformers(moe_model):
    family, d, m, ps, ref = moe_model
    check_greedy_batched_and_alone(d, ps, ref)


@pytest.mark.slow
def test_logits_match_transformers(moe_model):
    family, d, m, ps, ref = moe_model
    check_logits(d, m, ps)


@pytest.mark.slow
def test_fp8_weights_refused_for_experts(moe_model):
    family, d, *_ = moe_model
    from zerod.engine.core.engine import Engine, EngineConfig
    with pytest.raises(EngineError, match="FP8 weights for mixtures of experts are not supported"):
        Engine(EngineConfig(model=str(d), quantization="fp8", kv_pages=64))


def _raw(**over):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    raw.update(over)
    return raw


def test_sparse_layers_follow_step_and_dense_list():
    mc = parse_model_config(_raw(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert mc.moe_layers == [False, True, False, False]


@pytest.mark.parametrize("over, words", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts=0), "num_experts"),
    (dict(moe_intermediate_size=-5), "expert size"),
    (dict(decoder_sparse_step="x"), "invalid mixture-of-experts field"),
])
def test_bad_expert_fields_are_refused_clearly(over, words):
    with pytest.raises(EngineError, match=words):
        parse_model_config(_raw(**over))


def _case(t: int, h: int, i: int, e: int, k: int, dtype, skew: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if skew:   # most tokens to expert 0: one expert's run spans many blocks, others get few
        logits[:, 0] += 4.0
    w, ids = route(logits, k, True)
    return x, w13, w2, w, ids


# Triton's interpreter runs the kernel on CPU tensors; bf16 tl.dot is wrong there (see
# test_kernels_interpreter.py), so fp32 and fp16.
INTERPRETER_SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter
patch_triton_interpreter()
from zerod.engine.model import ops
from zerod.engine.kernels.moe import fused_experts
from zerod.engine.model.moe import fused_experts_reference
from test_families_moe import _case
bad = 0
for t, h, i, e, k, dtype, skew in [(1, 64, 32, 8, 2, torch.float32, False), (37, 64, 48, 8, 2, torch.float32, True),
                                   (300, 32, 32, 6, 3, torch.float32, False), (20, 64, 32, 16, 4, torch.float16, True)]:
    x, w13, w2, w, ids = _case(t, h, i, e, k, dtype, skew)
    got = fused_experts(x, w13, w2, w, ids, ops.silu_and_mul).float()
    want = fused_experts_reference(x.float(), w13.float(), w2.float(), w, ids, ops.silu_and_mul)
    rel = ((got - want).norm() / want.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    ok = rel <= tol and bool(torch.isfinite(got).all())
    bad += not ok
    print("PASS" if ok else "FAIL", t, h, i, e, k, dtype, skew, f"rel={rel:.2e}")
print("RESULT", "ok" if not bad else "bad")
"""


def test_fused_moe_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_in_interpreter(INTERPRETER_SCRIPT)


def test_alignment_groups_pairs_by_expert_in_interpreter():
    """Every (token, expert) pair appears once, in a block of its own expert, token order kept."""
    pytest.importorskip("triton")
    script = r"""
import torch
from kernel_checks import patch_triton_interpreter
patch_triton_interpreter()
from zerod.engine.kernels.moe import align
g = torch.Generator().manual_seed(1)
for t, e, k, bm in [(1, 8, 2, 16), (300, 6, 3, 16), (50, 128, 8, 64), (1100, 8, 8, 16)]:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    s, blk, total = align(ids, e, bm)
    total = int(total)
    flat = ids.reshape(-1)
    pairs = s[:total]
    real = pairs[pairs < t * k]
    assert sorted(real.tolist()) == list(range(t * k)), "each pair once"
    assert (s[total:] == t * k).all(), "past the total: padding"
    owner = blk.repeat_interleave(bm)[:total]
    assert (flat[real.long()] == owner[pairs < t * k]).all(), "pair in its expert's block"
    for x in range(e):
        mine = real[flat[real.long()] == x]
        assert (mine.diff() > 0).all(), "token order kept within an expert"
    assert total % bm == 0 and total <= s.numel()
print("RESULT ok")
"""
    run_in_interpreter(script)


# The router kernel against transformers' routing: the same experts with the same weights.
# Logits that tie (bf16 over 128 experts) may list tied experts in another order than
# torch.topk: what must hold is that each named expert carries the weight given it, and
# the weights are the k largest.
ROUTER_SCRIPT = r"""
import torch
from kernel_checks import patch_triton_interpreter
patch_triton_interpreter()
from test_families_moe import check_router
check_router(torch.device("cpu"))
print("RESULT ok")
"""


def check_router(device):
    from zerod.engine.kernels.router import route as route_kernel

    g = torch.Generator().manual_seed(7)
    for t, e, k, renorm, dtype in [(1, 8, 2, True, torch.bfloat16), (37, 8, 2, True, torch.float32),
                                   (200, 8, 2, True, torch.bfloat16), (5, 8, 3, False, torch.float32),
                                   (40, 128, 8, False, torch.bfloat16), (3, 60, 4, True, torch.float32),
                                   (2048, 128, 8, True, torch.bfloat16), (0, 8, 2, True, torch.bfloat16)]:
        logits = torch.randn(t, e, generator=g).to(dtype).to(device)
        w, ids = route_kernel(logits, k, renorm)
        w_ref, ids_ref = route_reference(logits, k, renorm)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == ids.shape == (t, k)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.gather(1, ids.long())
        if renorm:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(chosen, w, rtol=1e-5, atol=1e-6)   # each id carries its weight
        if t:
            assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), "k distinct experts"
        if dtype == torch.float32:   # no ties: the same experts in the same order
            assert torch.equal(ids.long(), ids_ref)


def test_router_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_in_interpreter(ROUTER_SCRIPT)


@pytest.mark.gpu
def test_router_kernel_on_gpu():
    check_router(torch.device("cuda"))


def test_router_refuses_more_experts_than_it_holds():
    pytest.importorskip("triton")
    from zerod.engine.kernels.router import MAX_EXPERTS, route as route_kernel

    with pytest.raises(ValueError, match="at most"):
        route_kernel(torch.zeros(1, MAX_EXPERTS + 1), 2, True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 200, 2048])
@pytest.mark.parametrize("shape", ["mixtral", "qwen3_moe"])
def test_fused_moe_kernel_on_gpu(t, shape):
    from zerod.engine.model.moe import fused_experts

    h, i, e, k = (1024, 1792, 8, 2) if shape == "mixtral" else (512, 256, 128, 8)
    x, w13, w2, w, ids = (v.cuda() for v in _case(t, h, i, e, k, torch.bfloat16, skew=t == 200, seed=t))
    got = fused_experts(x, w13, w2, w, ids, ops.silu_and_mul).float()
    want = fused_experts_reference(x.float(), w13.float(), w2.float(), w, ids, ops.silu_and_mul)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
    # graph-capturable: replaying a captured call gives the eager result
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_experts(x, w13, w2, w, ids, ops.silu_and_mul)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, w, ids, ops.silu_and_mul)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), got, atol=0, rtol=0)
