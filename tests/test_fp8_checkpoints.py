"""FP8 checkpoints as published (compressed-tensors per-channel + dynamic per-token,
per-tensor + static input scales; the "fp8" method with 128x128 blocks) and
`--quantization fp8` on a float checkpoint, on the CPU's dequantizing reference path.

Tolerances (|Δ log p| over the tokens the reference gives p > 1e-3, teacher-forced over a
24-token sequence, through the prefill, chunked-prefill and decode paths): against
transformers on the same weights dequantized, with W8A8 emulated by hooks that quantize
each projection's input the same way, mean <= 0.08 (per-channel: equal to 1e-4); against
the dequantized weights without activation quantization the mean error is what FP8
activations cost (~0.15 here) and must be at least twice the W8A8 one, so activations
are really quantized; `--quantization fp8` against the float model mean <= 0.35.
"""

from __future__ import annotations

import json

import pytest
import torch

import fp8_support as S
from zerod.engine.demo import generate
from zerod.engine.core.engine import SamplingParams
from zerod.engine.model.linear import Linear
from zerod.engine.quant.linear import W8A16_MAX_M, Fp8Linear


def _mean(a, b) -> float:
    keep = b.exp() > 1e-3
    return float((a - b).abs()[keep].mean())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = S.bf16_checkpoint(tmp_path_factory.mktemp("fp8") / "float")
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return d, S.sequence(vocab), S.sequence(vocab, seed=3)


@pytest.mark.parametrize("fmt,acts,tol", [("channel", "token", 1e-4), ("static", "static", 0.08),
                                          ("block", "group", 0.08)])
def test_fp8_checkpoint_matches_its_dequantized_weights(base, tmp_path, fmt, acts, tol):
    src, seq, calib = base
    scales = S.input_amax(src, [seq, calib]) if fmt == "static" else None
    q = S.write_fp8(src, tmp_path / fmt, fmt, input_scales=scales)
    deq = S.dequantized(q, tmp_path / "deq")
    eng = S.engine(q)
    try:
        assert isinstance(eng.model.layers[0].qkv, Fp8Linear)
        assert eng.model.layers[0].qkv.weight.dtype == torch.float8_e4m3fn
        assert type(eng.model.lm_head) is Linear   # the ignore list's lm_head stays in float
        got = S.engine_logprobs(eng, seq)
    finally:
        eng.shutdown(0)
    w8a8 = _mean(got, S.hf_logprobs(deq, seq, acts, scales))
    weights_only = _mean(got, S.hf_logprobs(deq, seq))
    assert w8a8 <= tol, f"{fmt}: mean |Δ log p| {w8a8:.4f} against W8A8 emulated"
    assert weights_only >= 2 * w8a8 and weights_only < 0.4, (fmt, weights_only, w8a8)


def test_online_fp8_quantization_of_a_float_checkpoint(base):
    src, seq, _ = base
    eng = S.engine(src, quantization="fp8")
    try:
        L = eng.model.layers[0]
        assert isinstance(L.gate_up, Fp8Linear) and L.gate_up.weight_scale.shape == (L.gate_up.out_features,)
        assert type(eng.model.lm_head) is Linear      # vLLM leaves the head unquantized too
        got = S.engine_logprobs(eng, seq)
    finally:
        eng.shutdown(0)
    assert _mean(got, S.hf_logprobs(src, seq)) <= 0.35


def test_ignored_layers_stay_in_float_and_greedy_serving_works(base, tmp_path):
    src, seq, _ = base
    q = S.write_fp8(src, tmp_path / "ign", "channel", ignore=("model.layers.1.mlp.down_proj",))
    eng = S.engine(q)
    eng.start()
    try:
        assert type(eng.model.layers[1].down) is Linear and eng.model.layers[1].down.weight.dtype == torch.float32
        assert isinstance(eng.model.layers[0].down, Fp8Linear)
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = generate(eng, [seq[:5], seq[:9]], sp)
        again = generate(eng, [seq[:5]], sp)
    finally:
        eng.shutdown(0)
    assert [len(o["token_ids"]) for o in out] == [8, 8]
    assert again[0]["token_ids"] == out[0]["token_ids"]    # batched equals alone


def test_fused_parts_ignored_unequally_are_refused(base, tmp_path):
    from zerod.engine.config import EngineError

    src, _, _ = base
    q = S.write_fp8(src, tmp_path / "half", "channel", ignore=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(EngineError, match="ignores model.layers.0.self_attn.q_proj but not"):
        S.engine(q)


def test_missing_scale_is_named(base, tmp_path):
    from safetensors.torch import load_file, save_file
    from zerod.engine.config import EngineError

    src, _, _ = base
    q = S.write_fp8(src, tmp_path / "noscale", "block")
    t = load_file(str(q / "model.safetensors"))
    del t["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(t, str(q / "model.safetensors"))
    with pytest.raises(EngineError, match="missing 1 tensor.*up_proj.weight_scale_inv"):
        S.engine(q)


def _logprobs(d, seq, **kw) -> torch.Tensor:
    eng = S.engine(d, **kw)
    try:
        return S.engine_logprobs(eng, seq)
    finally:
        eng.shutdown(0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,path", [("channel", "w8a16"), ("channel", "w8a8"), ("channel", "tensorwise"),
                                      ("channel", "fast"), ("block", "w8a8"), ("block", "w8a16")])
def test_fp8_on_gpu_matches_the_cpu_reference(base, tmp_path, monkeypatch, fmt, path):
    """The real kernels in bf16 with CUDA graphs and FP8 KV pages, every step on one path
    (W8A16_MAX_M and Tuning.fp8_one_token_tensorwise / fp8_tensorwise_max_m set so): the
    Triton W8A16 GEMM, or per-token quant + torch._scaled_mm (channel: row-wise, one-token
    steps through the tensorwise GEMM; or every step through the tensorwise GEMM; or "fast":
    the tensorwise GEMM to 200 rows and row-wise above, both with fast accumulation) / the
    Triton block GEMM (block). Against the CPU's float32 run of the same product with the same FP8
    KV pages: for W8A8 the checkpoint on the CPU's reference path, for W8A16 its
    dequantized weights (activations unquantized).

    The bound is what bf16 costs on the CPU, the same run in bf16 against float32: a
    bf16 rounding next to an e4m3 boundary moves a value a whole e4m3 step, so FP8 makes
    this tiny model sensitive to it: ~0.19 mean |Δ log p| with FP8 activations, ~0.06
    without (FP8 KV only), against 0.03 for the unquantized model. The GPU rounds
    elsewhere than the CPU, so the costs agree in size, not value: within 2x (the first
    H200 run, W8A8, equalled the CPU's 0.177 to three digits). A wrong scale, block or
    part order costs whole units, and taking the other path ~0.16."""
    src, seq, _ = base
    q = S.write_fp8(src, tmp_path / fmt, fmt)
    for scales in W8A16_MAX_M:   # the prefill graphs pad up to 512 tokens
        monkeypatch.setitem(W8A16_MAX_M, scales, 1 << 20 if path == "w8a16" else 0)
    # one-token steps too: the tensorwise GEMM is W8A8 (the H200 showed 0.136 against a
    # 0.109 bound with it under the W8A16 reference: the other path's cost)
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({
        "fp8_one_token_tensorwise": path != "w8a16", "fp8_fast_accum": path == "fast",
        "fp8_tensorwise_max_m": 1 << 20 if path == "tensorwise" else 200 if path == "fast" else 0}))
    same = S.dequantized(q, tmp_path / "deq") if path == "w8a16" else q
    truth = _logprobs(same, seq, kv_cache_dtype="fp8", device="cpu")
    bf16_cost = _mean(_logprobs(same, seq, kv_cache_dtype="fp8", dtype="bfloat16", device="cpu"), truth)
    # a pool of kv_pages (S.engine's), not a share of the GPU: an engine built earlier in
    # this process leaves its memory in torch's cache
    gpu = S.engine(q, device="cuda", kv_cache_dtype="fp8", max_model_len=128, max_num_seqs=8)
    gpu.start()
    try:
        assert gpu.runner.graphs, "decode CUDA graphs were not captured"
        if fmt == "channel" and path != "w8a16":   # the RMSNorm / SiLU·mul before quantize: checked too
            L = gpu.runner.model.layers[0]
            for m in (1, 24):
                h = torch.empty(m, L.qkv.in_features, dtype=torch.bfloat16, device="cuda")
                assert [p.takes_fp8(h) for p in (L.qkv, L.gate_up, L.down)] == [True] * 3
                assert L.down.way(h) == ("tensorwise" if path in ("tensorwise", "fast") or m == 1 else "w8a8")
        got = S.engine_logprobs(gpu, seq)
        out = generate(gpu, [seq[:5], seq[:9]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        gpu.shutdown(0)
    err = _mean(got, truth)
    assert err <= 2 * bf16_cost, f"{fmt} {path}: mean |Δ log p| {err:.3f} on the GPU, bf16 on the CPU {bf16_cost:.3f}"
    assert [len(o["token_ids"]) for o in out] == [8, 8]
