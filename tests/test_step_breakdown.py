"""gpu/step_breakdown.py on synthetic decode profiles, on the CPU: the model's shape read
from its config.json (a Mixtral-like one here), the kernels sorted into their rows, and
every bound checked against the same roofline computed by hand; without a config, the
built-in Llama-3-8B numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpu_scripts

SB = gpu_scripts.load("step_breakdown")
HBM, BF16 = SB.HBM, SB.PEAK["bf16"]   # the device's measured copy bandwidth and bf16 peak

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
KERNELS = [
    ["_moe_gemm", 700.0, 32.0],
    ["_moe_gemm_split", 300.0, 16.0],
    ["nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT gemm", 400.0, 48.0],
    ["_decode_split_kernel", 150.0, 16.0],
    ["_count_kernel", 10.0, 16.0],
    ["_offsets_kernel", 6.0, 16.0],
    ["_scatter_kernel", 9.0, 16.0],
    ["_route_kernel", 5.0, 16.0],
    ["void vllm::rms_norm_kernel<c10::BFloat16>", 40.0, 33.0],
    ["void at::native::sbtopk::gatherTopK<float>", 25.0, 16.0],
]


@pytest.fixture(scope="module")
def sb():
    return SB


def window(streams: int = 200, kernels=KERNELS) -> dict:
    return {"window": "200 x (24 in, 128 out) at once", "streams": streams, "steps": 100, "wall_s": 1.0,
            "tokens": 20000, "wall_ms_per_step": 10.0, "busy_ms_per_step": 9.0, "kernels": kernels}


def profile(tmp_path: Path, model: Path | str, quantization: str | None = None) -> Path:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"config": {"model": str(model), "quantization": quantization},
                             "windows": [window(1), window()]}))
    return p


@pytest.fixture
def mixtral_dir(tmp_path: Path) -> Path:
    d = tmp_path / "mixtral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MIXTRAL))
    return d


def row(rows, prefix: str):
    (found,) = [r for r in rows if r[0].startswith(prefix)]
    return found


def roofline_us(read_bytes: float, flops: float, peak: float) -> float:
    return 1e6 * max(read_bytes / HBM, flops / peak)


def test_mixtral_rows_and_bounds(sb, mixtral_dir):
    shape, source = sb.load_shape(None, str(mixtral_dir))
    assert source == str(mixtral_dir / "config.json")
    assert (shape.layers, shape.experts, shape.top_k, shape.intermediate, shape.head_dim) == (16, 8, 2, 14336, 128)
    assert shape.describe() == "Mixtral-like: 16 layers, 8 experts top-2"
    rows = sb.breakdown(window(), False, 88, shape)
    assert len(rows) == 5

    what, us, bound = row(rows, "experts (fused MoE GEMMs)")
    assert us == 700.0 + 300.0
    # 400 picks among 8 experts: every expert touched, each with gate, up and down
    touched = 8 * (1 - (7 / 8) ** 400)
    assert "8.0 of 8 experts a layer" in what
    expert = 3 * 4096 * 14336
    assert bound == pytest.approx(roofline_us(touched * expert * 2 * 16, 2 * 200 * 2 * expert * 16, BF16))
    assert bound == pytest.approx(1e6 * 8 * expert * 2 * 16 / HBM, rel=1e-6)   # weight reads bound it

    assert row(rows, "routing (the router's top k; count, offsets, scatter)")[1:] == (5.0 + 10.0 + 6.0 + 9.0, None)

    _, us, bound = row(rows, "GEMMs: attention projections + router")
    assert us == 400.0   # the cuBLAS GEMM alone: _moe_gemm is the experts'
    per_layer = {"qkv": 4096 * (4096 + 2 * 8 * 128), "o": 4096 * 4096, "router": 4096 * 8}
    want = sum(roofline_us(p * 16 * 2, 2 * 200 * p * 16, BF16) for p in per_layer.values())
    want += roofline_us(4096 * 32000 * 2, 2 * 200 * 4096 * 32000, BF16)
    assert bound == pytest.approx(want)

    _, us, bound = row(rows, "attention")
    assert us == 150.0
    assert bound == pytest.approx(1e6 * 200 * 88 * 2 * 8 * 128 * 2 * 16 / HBM)

    _, us, bound = rows[-1]
    assert "top-k" in rows[-1][0]
    assert (us, bound) == (40.0 + 25.0, None)


def test_experts_touched_and_fp8(sb, mixtral_dir):
    shape, _ = sb.load_shape(str(mixtral_dir / "config.json"), None)
    # one row, top-2: 8 (1 - (7/8)^2) = 1.875 experts a layer, weight reads dominate
    what, _, bound = row(sb.breakdown(window(1), False, 88, shape), "experts")
    assert "1.9 of 8 experts a layer" in what
    expert = 3 * 4096 * 14336
    assert bound == pytest.approx(1e6 * 1.875 * expert * 2 * 16 / HBM)
    # --quantization fp8 leaves the experts bf16 (the fused MoE kernel reads w13 / w2 as
    # bf16): their bound stays bf16's, bytes and peak
    _, _, bound = row(sb.breakdown(window(), True, 88, shape), "experts")
    touched = 8 * (1 - (7 / 8) ** 400)
    assert bound == pytest.approx(roofline_us(touched * expert * 2 * 16, 2 * 200 * 2 * expert * 16, BF16))


def test_llama_default_without_a_config(sb, tmp_path):
    shape, source = sb.load_shape(None, str(tmp_path / "absent"))
    assert shape == sb.LLAMA3_8B and "no config.json" in source
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads, shape.head_dim,
            shape.vocab) == (4096, 14336, 32, 32, 8, 128, 128256)
    dense = [k for k in KERNELS if not k[0].startswith("_moe")]
    rows = sb.breakdown(window(kernels=dense), False, 88)
    assert [r[0].split(":")[0].split(" (")[0] for r in rows] == [
        "GEMMs", "attention", "norms, RoPE, SiLU, KV writes, quantization, sampling, copies"]
    _, us, bound = rows[0]
    assert us == 400.0
    # 200 rows in bf16 are just past the ridge (2 x 200 / 808.4e12 > 2 / 4.245e12): FLOPs bound it
    params = 32 * (4096 * 2 * 14336 + 14336 * 4096 + 4096 * (4096 + 2 * 8 * 128) + 4096 * 4096) + 4096 * 128256
    assert bound == pytest.approx(1e6 * 2 * 200 * params / BF16)
    assert rows[1][2] == pytest.approx(1e6 * 200 * 88 * 2 * 8 * 128 * 2 * 32 / HBM)
    # the routing kernels, on no row of their own, are the rest's
    assert rows[2][1:] == (10.0 + 6.0 + 9.0 + 5.0 + 40.0 + 25.0, None)
    # a dense config.json gives the same shape's bounds
    cfg = tmp_path / "llama.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "vocab_size": 128256}))
    llama, _ = sb.load_shape(str(cfg), None)
    assert not llama.moe and llama.describe() == "Llama-like: 32 layers"
    assert [r[2] for r in sb.breakdown(window(kernels=dense), False, 88, llama)] == [r[2] for r in rows]


def test_main_prints_the_experts_row(sb, mixtral_dir, tmp_path, capsys):
    sb.main([str(profile(tmp_path, mixtral_dir)), "--window", "200 x"])
    out = capsys.readouterr().out
    assert "Mixtral-like: 16 layers, 8 experts top-2" in out
    assert "| experts (fused MoE GEMMs): 8.0 of 8 experts a layer" in out
    assert "experts: 62.5 µs a layer measured" in out    # 1000 us over 16 layers
    assert "| routing (the router's top k; count, offsets, scatter) | 30 | - | - |" in out
    # the profiled directory gone: --model-config names the config; without it, Llama-3-8B
    sb.main([str(profile(tmp_path, tmp_path / "gone")), "--model-config", str(mixtral_dir)])
    assert "| experts (fused MoE GEMMs)" in capsys.readouterr().out
    sb.main([str(profile(tmp_path, tmp_path / "gone"))])
    out = capsys.readouterr().out
    assert "Llama-3-8B (built in): 32 layers" in out and "| experts" not in out
    # a profile that recorded its model's config.json (gpu/decode_profile.py does) needs neither
    p = profile(tmp_path, tmp_path / "gone")
    p.write_text(json.dumps(dict(json.loads(p.read_text()), model_config=MIXTRAL)))
    sb.main([str(p)])
    out = capsys.readouterr().out
    assert "Mixtral-like: 16 layers, 8 experts top-2 (the profile's config.json)" in out
