"""Engine core on a CUDA GPU (skipped without one; run on the device H200 with `pytest -m gpu`)."""

from __future__ import annotations

import json

import pytest
import torch

from zerod.engine.model import ops
from zerod.engine.demo import generate, make_checkpoint
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams
from zerod.engine.runner import decode_sizes

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-llama")
    make_checkpoint(d, "llama", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    dtype="bfloat16", seed=3)
    return d


def test_graphs_run_and_free_pages(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", kv_pages=512,
                            max_model_len=256, max_num_seqs=32))
    assert e.runner.graphs, "decode CUDA graphs were not captured"
    e.start()
    try:
        prompts = [[5 + i] * (3 + 7 * i) for i in range(20)]
        res = generate(e, prompts, SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=1,
                                                  ignore_eos=True))
        assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 24 for r in res)
        st = e.stats()
        assert st.healthy and st.kv_pages_free == st.kv_pages_total
    finally:
        e.shutdown(0)


def test_decode_step_has_no_host_sync(ckpt):
    e = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", kv_pages=256,
                            max_model_len=256, max_num_seqs=8))
    e.start()
    try:
        generate(e, [[7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        torch.cuda.set_sync_debug_mode("error")
        try:
            r = generate(e, [[7, 8, 9], [10, 11]], SamplingParams(max_tokens=16, temperature=0.5, ignore_eos=True))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert [x["finish_reason"] for x in r] == ["length", "length"]
    finally:
        e.shutdown(0)


def test_decode_graphs_placed_by_cost_serve_every_batch_as_the_ladder(ckpt, monkeypatch):
    """Tuning.decode_graphs_by_cost: graphs at the measured sizes, and each batch size
    decodes the tokens the fixed ladder's graphs give."""
    prompts = [[5 + i] * (3 + 5 * i) for i in range(27)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = {}
    for count in (0, 7):
        monkeypatch.setenv("ZEROD_TUNING", json.dumps({"decode_graphs_by_cost": count}))
        # float32: the two sets of graphs pad a batch to different row counts, whose GEMMs
        # may sum in another order; in bf16 that alone can flip a greedy token
        e = Engine(EngineConfig(model=str(ckpt), device="cuda", dtype="float32", kv_pages=512,
                                max_model_len=256, max_num_seqs=40))
        sizes = e.runner.buckets
        e.start()
        try:
            out[count] = [r["token_ids"] for r in generate(e, prompts, sp)]
        finally:
            e.shutdown(0)
        if count:
            assert len(sizes) <= count and sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 40
            assert set(sizes) <= set(decode_sizes.candidates(40))
    assert out[7] == out[0]


@pytest.mark.parametrize("name", ["rms_norm", "silu_and_mul", "decode_attention"])
def test_kernels_match_reference(name):
    if not ops.has_kernel(name):
        pytest.skip(f"no CUDA kernel {name}")
    torch.manual_seed(0)
    dev = "cuda"
    if name == "rms_norm":
        args = (torch.randn(7, 256, device=dev, dtype=torch.bfloat16), torch.randn(256, device=dev, dtype=torch.bfloat16), 1e-5)
    elif name == "silu_and_mul":
        args = (torch.randn(7, 512, device=dev, dtype=torch.bfloat16),)
    else:
        kc = torch.randn(32, 16, 2, 64, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(32, 16, 2, 64, device=dev, dtype=torch.bfloat16)
        bt = torch.randint(1, 32, (3, 8), device=dev, dtype=torch.int32)
        args = (torch.randn(3, 8, 64, device=dev, dtype=torch.bfloat16), kc, vc, bt,
                torch.tensor([1, 40, 128], device=dev, dtype=torch.int32), 0.125)
    fn = getattr(ops, name)
    got = fn(*args)
    with ops.kernels_disabled([name]):
        ref = fn(*args)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
