"""The quantization of a model, parsed once: what the checkpoint's `quantization_config`
says (read with the compressed-tensors library where it is that format), or what
`--quantization fp8` asks of a bf16 checkpoint. Anything else is refused here, naming
the method, before a byte of weights is read.

Served (docs/design.md, "FP8"):
- compressed-tensors, float 8-bit weights (per tensor or per output channel) with
  8-bit float activations, static (one per-tensor input_scale) or dynamic per token,
  or none (weight-only);
- "fp8" (vLLM / transformers FineGrainedFP8): `weight_block_size` [bn, bk] with
  `weight_scale_inv` per block and dynamic activations per token and group of bk,
  or without blocks one per-tensor `weight_scale` (+ `input_scale` when static);
- `--quantization fp8` on an unquantized checkpoint: e4m3 weights with a scale per
  output channel, activations quantized per token at run time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config import QUANTIZATIONS, EngineError


@dataclass(frozen=True)
class QuantConfig:
    source: str                        # "compressed-tensors" | "fp8" | "online" (--quantization fp8)
    weights: str                       # "tensor" | "channel" | "block": one scale per ...
    activations: str                   # "token" (dynamic per token / token group) | "static" | "none"
    block: tuple[int, int] | None = None   # (rows, cols) of a weight block; None unless weights == "block"
    ignore: tuple[str, ...] = ()       # HF module names (or "re:" patterns) left unquantized
    kv_scales: bool = False            # the checkpoint stores k_scale / v_scale per layer

    @property
    def checkpoint_fp8(self) -> bool:
        """The weights on disk are float8 (else bf16 weights quantized at load)."""
        return self.source != "online"

    @property
    def scale_name(self) -> str:
        """The tensor that holds a weight's scales in the checkpoint."""
        return "weight_scale_inv" if self.weights == "block" else "weight_scale"

    def ignored(self, module: str) -> bool:
        """Whether the HF module (e.g. model.layers.0.self_attn.q_proj) stays unquantized."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return True
            elif module == pat or module.endswith("." + pat):
                return True
        return False


def quantizes(quant: QuantConfig | None, parts: list[tuple[str, int]], in_features: int) -> bool:
    """Whether the projection fused from the HF modules `parts` ((name, rows) in order)
    is FP8. Refuses fused parts that disagree on being ignored, and block weights that do
    not tile each part: the engine fuses them into one projection, quantized alike."""
    if quant is None:
        return False
    ignored = {m: quant.ignored(m) for m, _ in parts}
    if len(set(ignored.values())) > 1:
        raise EngineError(f"quantization ignores {', '.join(m for m, i in ignored.items() if i)} but not "
                          f"{', '.join(m for m, i in ignored.items() if not i)}: the engine fuses them "
                          f"into one projection, which must be quantized alike")
    if all(ignored.values()):
        return False
    if quant.weights == "block":
        bn, bk = quant.block
        if any(rows % bn for _, rows in parts[:-1]):   # a fused part must start a block
            raise EngineError(f"{parts[0][0]}: {sum(r for _, r in parts)}x{in_features} does not divide "
                              f"into the checkpoint's {bn}x{bk} weight blocks")
    return True


def online_fp8() -> QuantConfig:
    """`--quantization fp8`: the LM head stays in the model dtype, as vLLM does."""
    return QuantConfig("online", "channel", "token", ignore=("lm_head",))


def resolve(checkpoint: QuantConfig | None, flag: str | None) -> QuantConfig | None:
    """The quantization to serve: the checkpoint's (hf_config parsed it) and the
    `--quantization` flag (None: follow the checkpoint). An FP8 checkpoint is served as
    published whether or not the flag says fp8."""
    if flag is not None and flag not in QUANTIZATIONS:
        raise EngineError(f"quantization {flag!r} is not supported; use "
                          f"{', '.join(QUANTIZATIONS)} (or leave it out for the checkpoint's own)")
    if checkpoint is not None:
        return checkpoint
    return online_fp8() if flag == "fp8" else None


def parse_checkpoint(raw: Any, where: str) -> QuantConfig:
    if not isinstance(raw, dict):
        raise EngineError(f"{where}: quantization_config must be an object, not {raw!r}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "fp8":
        return _fp8(raw, where)
    raise EngineError(f"{where}: quantization method {method or '(not named)'!r} is not supported; "
                      f"zerod's engine serves FP8 checkpoints (compressed-tensors float8, fp8) and "
                      f"unquantized bfloat16 / float16 / float32 ones")


def _refuse(where: str, what: str) -> EngineError:
    return EngineError(f"{where}: compressed-tensors checkpoint with {what} is not supported; "
                       f"zerod's engine serves its float8 schemes (FP8 weights per tensor or "
                       f"channel, FP8 activations static or per token)")


def _compressed_tensors(raw: dict, where: str) -> QuantConfig:
    # the format's own reader; it imports torch, so reading a compressed-tensors checkpoint
    # is the one case where the spec (and doctor) loads torch
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        cfg = QuantizationConfig.model_validate(raw)
    except ValidationError as exc:
        raise EngineError(f"{where}: unreadable compressed-tensors quantization_config: "
                          f"{exc.errors()[0].get('msg', exc)}") from None
    schemes = list(cfg.config_groups.values())
    if len(schemes) != 1:
        raise _refuse(where, f"{len(schemes)} config groups (one scheme for every Linear is served)")
    s = schemes[0]
    w, a = s.weights, s.input_activations
    if s.output_activations is not None:
        raise _refuse(where, "quantized output activations")
    if w is None or w.type != "float" or w.num_bits != 8 or not w.symmetric:
        kind = "no weights" if w is None else f"{w.num_bits}-bit {w.type} weights"
        raise _refuse(where, kind)
    if w.strategy not in ("tensor", "channel", "block") or w.dynamic:
        raise _refuse(where, f"float8 weights with strategy {w.strategy!r}")
    block = None
    if w.strategy == "block":
        block = tuple(w.block_structure or ())
        if len(block) != 2:
            raise _refuse(where, "block weights without a block_structure")
    if a is None:
        acts = "none"
    elif a.type != "float" or a.num_bits != 8:
        raise _refuse(where, f"{a.num_bits}-bit {a.type} activations")
    elif a.dynamic and (a.strategy == "token" or (w.strategy == "block" and a.strategy == "group")):
        acts = "token"     # block weights: per token and group of block[1] columns
    elif not a.dynamic and a.strategy == "tensor":
        acts = "static"
    else:
        raise _refuse(where, f"{'dynamic' if a.dynamic else 'static'} {a.strategy} activations")
    if w.strategy == "block" and acts == "static":
        raise _refuse(where, "block weights with static activations")
    return QuantConfig("compressed-tensors", str(w.strategy), acts, block=block,
                       ignore=tuple(cfg.ignore or ()), kv_scales=cfg.kv_cache_scheme is not None)


def _fp8(raw: dict, where: str) -> QuantConfig:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise EngineError(f"{where}: fp8 format {raw.get('fmt')!r} is not supported (e4m3 is)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise EngineError(f"{where}: fp8 activation_scheme {scheme!r} is not dynamic or static")
    ignore = tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ())
    block = raw.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", "token" if scheme == "dynamic" else "static", ignore=ignore)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise EngineError(f"{where}: weight_block_size must be two positive integers, not {block!r}")
    if scheme != "dynamic":
        raise EngineError(f"{where}: fp8 block-wise weights need activation_scheme dynamic, not {scheme!r}")
    return QuantConfig("fp8", "block", "token", block=(block[0], block[1]), ignore=ignore)
