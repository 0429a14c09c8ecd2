"""Shared by tests/test_fp8_*.py: a tiny transformers Llama, FP8 checkpoints written from
it in the published layouts, the references they are checked against, and teacher-forced
log-probabilities from the engine. Holds no tests of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zerod.engine.demo import write_tokenizer
from zerod.engine.core.engine import Engine, EngineConfig
from zerod.engine.quant import fp8

# every width a multiple of 128, so [128, 128] blocks tile each projection and each fused part
LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ_LEN = 24


def bf16_checkpoint(d: Path, seed: int = 7) -> Path:
    """The tiny Llama as transformers saves it (float32), with weights of a trained
    model's scale (std 1/sqrt(fan_in): activations of order 1, where FP8's relative
    error is what it is on a real checkpoint) and a head sharp enough for clear top tokens."""
    import transformers

    vocab = write_tokenizer(d) + 16
    config = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **LLAMA)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, (4.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5)
    model.save_pretrained(str(d))
    return d


def sequence(vocab: int, seed: int = 11) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (SEQ_LEN,), generator=g).tolist()


def _copy_without_weights(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _is_proj(name: str) -> bool:
    return any(name.endswith(f"{p}.weight") for p in PROJ)


def write_fp8(src: Path, dst: Path, fmt: str, ignore: tuple[str, ...] = (),
              input_scales: dict[str, float] | None = None) -> Path:
    """An FP8 checkpoint of src's weights, as published:
    - "channel": compressed-tensors, weight float8 + weight_scale [out, 1], dynamic per-token activations;
    - "static": compressed-tensors, per-tensor weight_scale and static input_scale (input_scales[module]);
    - "block": the "fp8" method, weight float8 + weight_scale_inv [out/128, in/128], dynamic activations.
    Modules in `ignore` (HF names) stay in float."""
    cfg = _copy_without_weights(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        module = name[:-len(".weight")]
        if not _is_proj(name) or module in ignore:
            out[name] = w
            continue
        if fmt == "block":
            q, s = fp8.quantize_blocks(w, (128, 128))
            out[name], out[module + ".weight_scale_inv"] = q, s
        elif fmt == "channel":
            q, s = fp8.quantize_rows(w)
            out[name], out[module + ".weight_scale"] = q, s.unsqueeze(1)
        else:
            s = w.abs().amax() / fp8.FP8_MAX
            out[name], out[module + ".weight_scale"] = fp8.quantize(w, s), s.reshape(())
            out[module + ".input_scale"] = torch.tensor(input_scales[module], dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"))
    cfg["quantization_config"] = _config(fmt, list(ignore) + ["lm_head"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _config(fmt: str, ignore: list[str]) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128], "ignored_layers": ignore}
    static = fmt == "static"
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ignore, "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "tensor" if static else "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "dynamic": not static, "strategy": "tensor" if static else "token"}}}}


def dequantized(src: Path, dst: Path) -> Path:
    """A plain float32 checkpoint of an FP8 one's weights as it means them (scales applied)."""
    cfg = _copy_without_weights(src, dst)
    cfg.pop("quantization_config")
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        module = name[:-len(".weight")]
        if w.dtype == fp8.FP8:
            if module + ".weight_scale_inv" in tensors:
                w = fp8.dequantize_blocks(w, tensors[module + ".weight_scale_inv"], (128, 128))
            else:
                w = w.float() * tensors[module + ".weight_scale"].reshape(-1, 1)
        out[name] = w.float()
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_logprobs(d: Path, seq: list[int], acts: str = "none", input_scales: dict | None = None,
                quantized: tuple[str, ...] = PROJ) -> torch.Tensor:
    """Teacher-forced log-probabilities [len-1, V] after tokens 1.. of seq, of transformers (float32, eager) on d;
    acts emulates W8A8: "token" (per token), "group" (per token and 128 columns) or
    "static" (input_scales[module]) on the inputs of the `quantized` projections."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    if acts != "none":
        for name, mod in m.named_modules():
            if name.split(".")[-1] not in quantized:
                continue

            def hook(_m, args, name=name):
                x = args[0]
                flat = x.reshape(-1, x.shape[-1])
                if acts == "token":
                    y = fp8.qdq_rows(flat)
                elif acts == "group":
                    y = fp8.qdq_groups(flat, 128)
                else:
                    y = fp8.qdq_static(flat, torch.tensor(input_scales[name]))
                return (y.reshape(x.shape),)
            mod.register_forward_pre_hook(hook)
    with torch.no_grad():
        logits = m(torch.tensor([seq])).logits[0, 1:].float()
    return torch.log_softmax(logits, -1)


def input_amax(d: Path, seqs: list[list[int]]) -> dict[str, float]:
    """Static input scales (amax / 448 of each projection's input over seqs): a calibration."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    for name, mod in m.named_modules():
        if name.split(".")[-1] in PROJ:
            def hook(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            mod.register_forward_pre_hook(hook)
    with torch.no_grad():
        for s in seqs:
            m(torch.tensor([s]))
    return {k: v / fp8.FP8_MAX for k, v in amax.items()}


def engine_logprobs(eng: Engine, seq: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities [len-1, V] after tokens 1.. of seq (score_last needs
    two tokens) from the engine: each prefix scored
    through its three attention paths (prefill, chunk over a cached prefix, decode)."""
    rows = []
    for t in range(2, len(seq) + 1):
        logits = eng.runner.score_last(seq[:t], max(1, (t - 1) // 2))
        rows.append(torch.log_softmax(logits.float().cpu(), -1))
    return torch.stack(rows)


def engine(d: Path, **kw) -> Engine:
    kw = {"block_size": 4, "kv_pages": 64, **kw}
    return Engine(EngineConfig(model=str(d), **kw))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |Δ log p| over the positions, on the tokens the reference finds likely
    (p > 1e-3): the tail of the distribution is noise for any quantization."""
    keep = b.exp() > 1e-3
    return float((a - b).abs()[keep].max())
