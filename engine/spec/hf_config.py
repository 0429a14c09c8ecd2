"""Read a Hugging Face `config.json` (and `generation_config.json`) into ModelConfig;
refuse what the engine cannot run, naming it. Imports no torch: `zerod doctor` reads a
checkpoint with this very parser (docs/design.md, "The model spec")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import EngineError
from .families import BY_ARCHITECTURE, BY_NAME, Family
from .quant import QuantConfig, parse_checkpoint
from .rope_scaling import parse_scaling
from .sizing import expert_layout

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    hidden_act: str = "silu"              # silu | gelu_tanh (the gate's activation)
    attn_scale: float | None = None       # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0             # Gemma 2: scores -> cap * tanh(score / cap); 0 = off
    final_softcap: float = 0.0            # Gemma 2: the same on the logits
    layer_windows: list[int] | None = None  # Gemma: per layer, the sliding window (0 = global attention)
    local_rope_theta: float | None = None   # Gemma 3: the sliding layers' own RoPE base (no scaling)
    gemma_norms: bool = False             # weights stored as w - 1; norms after attention and MLP too;
                                          # embeddings scaled by sqrt(hidden_size)
    num_experts: int = 0                  # mixture of experts (moe.py); 0 = every MLP is dense
    experts_per_token: int = 0            # top-k of the router
    moe_intermediate_size: int = 0        # one expert's intermediate size
    norm_topk_prob: bool = True           # renormalise the top-k probabilities to sum to 1
    moe_layers: list[bool] | None = None  # per layer: True = experts, False = the dense MLP
    quant: QuantConfig | None = None      # the checkpoint's quantization (FP8), None: unquantized

    @property
    def spec(self) -> Family:
        """The family's declaration (families.py): its traits and refusals."""
        return BY_NAME[self.family]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def parse_model_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """ModelConfig of a config.json's dict; EngineError naming what the engine cannot run
    or what the file gets wrong (a value of the wrong type included)."""
    try:
        return _parse(raw, where)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as exc:
        raise EngineError(f"{where}: a field has a value the engine cannot read ({exc})") from None


def _parse(raw: dict[str, Any], where: str) -> ModelConfig:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in BY_ARCHITECTURE:
        mt = raw.get("model_type")
        raise EngineError(
            f"{where}: unsupported architecture {arch or mt or '(none given)'!r}; "
            f"zerod's engine runs {', '.join(sorted(BY_ARCHITECTURE))}"
        )
    fam = BY_ARCHITECTURE[arch]
    family = fam.name
    qc = raw.get("quantization_config")
    quant = parse_checkpoint(qc, where) if qc else None   # FP8 served; any other method refused, named
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(raw["num_hidden_layers"])
        inter = int(raw["intermediate_size"])
        vocab = int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise EngineError(f"{where}: missing or invalid field {exc} for {arch}") from None
    if min(hidden, heads, kv_heads, head_dim, layers, inter, vocab) < 1:
        raise EngineError(f"{where}: sizes must be positive")
    if heads % kv_heads:
        raise EngineError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise EngineError(f"{where}: head_dim {head_dim} must be even for RoPE")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if fam.gemma_norms and act == "gelu":
        act = "gelu_pytorch_tanh"    # transformers runs Gemma's "gelu" as the tanh approximation
    if act not in _ACTS:
        raise EngineError(f"{where}: hidden activation {act!r} is not supported ({', '.join(_ACTS)})")

    # transformers >= 5 writes rope_parameters (Gemma 3: one per layer type);
    # older configs rope_theta + rope_scaling (+ rope_local_base_freq).
    rp = raw.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in rp:
        local_theta = float((rp.get("sliding_attention") or {}).get("rope_theta") or 10000.0)
        rp = rp["full_attention"] or {}
        raw = dict(raw, rope_parameters=rp)
    elif fam.local_rope:
        local_theta = float(raw.get("rope_local_base_freq") or 10000.0)
    theta = float(raw.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    max_pos = int(raw.get("max_position_embeddings") or 4096)
    scaling = parse_scaling(raw, head_dim, max_pos, where)
    partial = raw.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise EngineError(f"{where}: partial_rotary_factor {partial} is not supported (RoPE over the whole head)")

    qkv_bias = fam.qkv_bias or bool(raw.get("attention_bias", False))
    o_bias = not fam.qkv_bias and bool(raw.get("attention_bias", False))
    gemma = _gemma_fields(raw, fam, layers, where) if fam.sliding == "gemma" else {}
    if fam.sliding != "gemma":
        gemma["layer_windows"] = _layer_windows(raw, fam, layers)
    moe = _moe_fields(raw, fam, where) if fam.experts else {}
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_ids=_ids(raw.get("eos_token_id")),
        qk_norm=fam.qk_norm,
        hidden_act=_ACTS[act],
        local_rope_theta=local_theta,
        quant=quant,
        **gemma,
        **moe,
    )


def _layer_windows(raw: dict[str, Any], fam: Family, layers: int) -> list[int] | None:
    """Mistral / Phi-3: every layer slides when sliding_window is set. Qwen2 / Qwen3 with
    use_sliding_window: the layers layer_types names, else those from max_window_layers on."""
    window = raw.get("sliding_window")
    if not (isinstance(window, int) and window > 0):
        return None
    if fam.sliding == "every":
        return [window] * layers
    if fam.sliding == "opt_in" and raw.get("use_sliding_window"):
        types = raw.get("layer_types")
        if not types or len(types) != layers:
            first = int(raw.get("max_window_layers") or 0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        windows = [window if t == "sliding_attention" else 0 for t in types]
        return windows if any(windows) else None
    return None


def _moe_fields(raw: dict[str, Any], fam: Family, where: str) -> dict[str, Any]:
    """The experts (sizing.expert_layout: which layers, how many, what size), the router's
    top-k, and whether it renormalises (Mixtral always; Qwen3-MoE with norm_topk_prob)."""
    try:
        layout = expert_layout(raw)
        top_k = int(raw.get("num_experts_per_tok") or 0)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"{where}: invalid mixture-of-experts field ({exc})") from None
    if layout.num_experts < 1 or not 1 <= top_k <= layout.num_experts or layout.expert_size < 1:
        raise EngineError(f"{where}: a mixture of experts needs num_experts >= 1, 1 <= num_experts_per_tok "
                          f"<= num_experts and a positive expert size (got {layout.num_experts}, {top_k}, "
                          f"{layout.expert_size})")
    return dict(
        num_experts=layout.num_experts,
        experts_per_token=top_k,
        moe_intermediate_size=layout.expert_size,
        norm_topk_prob=fam.experts == "every" or bool(raw.get("norm_topk_prob", False)),
        moe_layers=layout.sparse,
    )


def _gemma_fields(raw: dict[str, Any], fam: Family, layers: int, where: str) -> dict[str, Any]:
    """Gemma 2 / 3: sliding and global layers, soft-caps, the attention scale."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:  # configs written before layer_types: the families' fixed patterns
        pattern = int(raw.get("sliding_window_pattern") or fam.sliding_pattern)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise EngineError(f"{where}: layer_types must name sliding_attention or full_attention "
                          f"for each of the {layers} layers")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise EngineError(f"{where}: sliding layers need a positive sliding_window, not {window!r}")
    scalar = raw.get("query_pre_attn_scalar")
    return dict(
        layer_windows=[window if t == "sliding_attention" else 0 for t in types],
        attn_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        gemma_norms=fam.gemma_norms,
    )


def read_config_json(model_dir: Path | str) -> dict[str, Any]:
    """config.json of a checkpoint folder as a dict; EngineError saying what is wrong."""
    p = Path(model_dir) / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise EngineError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{p}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise EngineError(f"{p}: not a JSON object")
    return raw


def read_generation_config(model_dir: Path | str) -> dict[str, Any]:
    """generation_config.json as a dict (the checkpoint's sampling defaults and extra EOS
    ids); empty when the folder has none or it is not a readable JSON object, as
    transformers treats it: an optional file."""
    try:
        g = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return g if isinstance(g, dict) else {}


def with_generation_config(mc: ModelConfig, gen: dict[str, Any]) -> ModelConfig:
    """mc with generation_config.json's EOS ids added to config.json's."""
    try:
        extra = _ids(gen.get("eos_token_id"))
    except (TypeError, ValueError):
        extra = []
    for t in extra:
        if t not in mc.eos_token_ids:
            mc.eos_token_ids.append(t)
    return mc


def load_model_config(model_dir: Path | str) -> ModelConfig:
    mc = parse_model_config(read_config_json(model_dir), str(Path(model_dir) / "config.json"))
    return with_generation_config(mc, read_generation_config(model_dir))
