"""The hot ops' torch references against plain dense formulas, and their dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerod.engine.model import ops
from zerod.engine.sampling.sampler import gumbel_noise


def _paged(seqs_k, seqs_v, page, n_pages, hk, d, seed=0):
    """Scatter per-sequence K/V ([L, Hk, D]) into a shuffled page pool; returns caches and tables."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(n_pages, page, hk, d)
    vc = torch.zeros(n_pages, page, hk, d)
    free = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()   # page 0 = scratch
    tables = []
    for k, v in zip(seqs_k, seqs_v):
        L = k.shape[0]
        pages = [free.pop() for _ in range((L + page - 1) // page)]
        slots = torch.tensor([pages[i // page] * page + i % page for i in range(L)])
        ops.write_kv(k, v, kc, vc, slots)
        tables.append(pages)
    w = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32)
    return kc, vc, bt


def _dense_causal(q, k, v, scale, offset):
    """q [N, Hq, D] at positions offset..offset+N-1 over k/v [C, Hk, D]."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,chd->hnc", q, k) * scale
    qpos = torch.arange(offset, offset + q.shape[0])[:, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v)


@pytest.mark.parametrize("page", [4, 16])
def test_prefill_and_decode_attention_match_dense(page):
    torch.manual_seed(0)
    hq, hk, d = 8, 2, 16
    lens = [1, 5, 16, 23]
    ks = [torch.randn(L, hk, d) for L in lens]
    vs = [torch.randn(L, hk, d) for L in lens]
    kc, vc, bt = _paged(ks, vs, page, 64, hk, d)
    scale = d ** -0.5
    # prefill: chunks = the last n tokens of each context (a cached prefix for some)
    chunk = [1, 3, 16, 10]
    qs = [torch.randn(n, hq, d) for n in chunk]
    cu = torch.tensor([0] + list(torch.tensor(chunk).cumsum(0)), dtype=torch.int32)
    out = ops.prefill_attention(torch.cat(qs), kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32), scale)
    for b, (q, L) in enumerate(zip(qs, lens)):
        ref = _dense_causal(q, ks[b], vs[b], scale, L - q.shape[0])
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], ref, atol=1e-5, rtol=1e-5)
    # decode: one query per sequence at its last position
    qd = torch.randn(len(lens), hq, d)
    out = ops.decode_attention(qd, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), scale)
    for b, L in enumerate(lens):
        ref = _dense_causal(qd[b:b + 1], ks[b], vs[b], scale, L - 1)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-5, rtol=1e-5)


def test_rope_matches_hf_rotate_half():
    from zerod.engine.spec.hf_config import ModelConfig
    from zerod.engine.model.rope import cos_sin_cache
    mc = ModelConfig("LlamaForCausalLM", "llama", 10, 32, 64, 1, 4, 2, 8, 1e-5, 10000.0, None, 64,
                     False, False, False, False, None, None)
    cache = cos_sin_cache(mc, 64, torch.float32, "cpu")
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    pos = torch.tensor([0, 3, 7, 63, 1])
    q2, k2 = ops.apply_rope(q, k, pos, cache)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]

    def rot(x):
        return torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(q2, q * cos + rot(q) * sin)
    torch.testing.assert_close(k2, k * cos + rot(k) * sin)


def test_norms_and_silu():
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref)
    n, res = ops.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(n, ops.rms_norm(x + r, w, 1e-6))
    y = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_and_mul(y), F.silu(y[:, :5]) * y[:, 5:])


def test_kernels_dispatch_only_on_cuda(monkeypatch):
    called = []
    monkeypatch.setattr(ops, "_K", {"rms_norm": lambda *a: called.append(1)})
    ops.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    assert called == []          # CPU tensors always take the reference
    assert ops.has_kernel("rms_norm") and not ops.has_kernel("decode_attention")


def test_gumbel_noise_is_batch_independent():
    seeds = torch.tensor([5, 77, 123456789012345], dtype=torch.int64)
    gen = torch.tensor([0, 3, 9], dtype=torch.int64)
    all3 = gumbel_noise(seeds, gen, 50)
    one = gumbel_noise(seeds[1:2], gen[1:2], 50)
    assert torch.equal(all3[1:2], one)
    assert not torch.equal(all3[0], all3[1])
    assert torch.isfinite(all3).all()
    assert not torch.equal(gumbel_noise(seeds[:1], gen[:1] + 1, 50), all3[:1])


def test_kernels_disabled_restores_what_was_off_before():
    from zerod.engine.model import ops

    ops.DISABLED.add("rms_norm")
    try:
        with ops.kernels_disabled(["decode_attention"]):
            assert {"rms_norm", "decode_attention"} <= ops.DISABLED
            assert not ops.has_kernel("decode_attention")
        assert "decode_attention" not in ops.DISABLED and "rms_norm" in ops.DISABLED
    finally:
        ops.DISABLED.discard("rms_norm")


@pytest.mark.parametrize("flash_max,pad", [(0, False), (64, True), (0, True)])
def test_fresh_prompts_sdpa_matches_dense_with_and_without_padded_lengths(flash_max,
                                                                          pad):
    """engine/model/decoder.py's per-sequence SDPA for fresh prompts: the plan-free backends up to
    Tuning.sdpa_flash_max_len, above it the default with each length padded up to one of a
    bounded set (trailing zeros: exact under the causal mask)."""
    from zerod.engine.model import decoder as model
    from zerod.engine.tuning import Tuning

    tuning = Tuning(sdpa_flash_max_len=flash_max, sdpa_pad_lengths=pad)
    g = torch.Generator().manual_seed(3)
    lens = [1, 5, 17, 100, 129]
    T, hq, hk, d = sum(lens), 4, 2, 16
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hk, hk))
    got = model._sdpa_varlen(q, k, v, lens, 0.25, tuning)
    s0 = 0
    for n in lens:
        want = _dense_causal(q[s0:s0 + n], k[s0:s0 + n], v[s0:s0 + n], 0.25, 0)
        torch.testing.assert_close(got[s0:s0 + n], want, rtol=1e-4, atol=1e-5)
        s0 += n
    # the padded lengths: within an eighth, and few of them
    assert [model.sdpa_length(n) for n in (1, 16, 17, 100, 128, 129, 1000, 16368)] == [
        16, 16, 32, 112, 128, 144, 1024, 16384]
    assert len({model.sdpa_length(n) for n in range(1, 16385)}) <= 8 * 11 + 1
    assert all(model.sdpa_length(n) - n <= max(15, n // 8) for n in range(1, 5000))
