"""How an FP8 model's tensors load: the loader's table of HF tensor name -> where it goes,
extended for `Fp8Linear` (weights, their scales, static input scales), the KV cache's
k_scale / v_scale, and random FP8 weights for `--load-format dummy`.

Each entry here is a function of the checkpoint tensor (and the file name, for errors):
the fused layout makes a tensor land at a row offset, per-tensor scales spread over the
rows of their part, and input scales of fused parts take the largest.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import EngineError
from .fp8 import FP8
from .linear import Fp8Linear

Loader = Callable[[torch.Tensor, str], None]


def fp8_loaders(model, base: dict) -> tuple[dict[str, Loader], set[str]]:
    """(loaders, optional names): for every checkpoint tensor that belongs to an
    Fp8Linear, a loader replacing the plain copy of `base` (HF name -> loader._Target:
    parameter, row offset, the tensor's shape); the KV scales are optional (a checkpoint
    without them keeps 1.0). Never split over tensor-parallel ranks (parallel.check_tp)."""
    owner = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    loaders: dict[str, Loader] = {}
    for name, tgt in base.items():
        m = owner.get(id(tgt.param))
        off, rows = tgt.off, tgt.shape[0]
        if m is None or not name.endswith(".weight"):
            continue
        prefix = name[:-len("weight")]
        s = m.scheme
        if not s.checkpoint_fp8:
            loaders[name] = _quantize_rows(m, name, off, rows)
            continue
        loaders[name] = _fp8_rows(m, name, off, rows)
        loaders[prefix + s.scale_name] = _scale_rows(m, prefix + s.scale_name, off, rows)
        if s.activations == "static":
            loaders[prefix + "input_scale"] = _input_scale(m, prefix + "input_scale")
    optional: set[str] = set()
    for n, L in enumerate(model.layers):
        p = f"model.layers.{n}.self_attn."
        for kind in ("k", "v"):   # compressed-tensors / vLLM name them two ways
            for name in (f"{p}{kind}_scale", f"{p}{kind}_proj.output_scale"):
                loaders[name] = _kv_scale(L, kind, name)
                optional.add(name)
    return loaders, optional


def _shape_error(fname: str, name: str, got, want) -> EngineError:
    return EngineError(f"{fname}: tensor {name} has shape {tuple(got)}, config.json implies {tuple(want)}")


def _fp8_rows(m: Fp8Linear, name: str, off: int, rows: int) -> Loader:
    def load(src: torch.Tensor, fname: str) -> None:
        if src.dtype != FP8:
            raise EngineError(f"{fname}: tensor {name} is {src.dtype}, the quantization_config "
                              f"says float8_e4m3fn")
        if tuple(src.shape) != (rows, m.in_features):
            raise _shape_error(fname, name, src.shape, (rows, m.in_features))
        m.weight.data[off:off + rows].copy_(src)
    return load


def _quantize_rows(m: Fp8Linear, name: str, off: int, rows: int) -> Loader:
    def load(src: torch.Tensor, fname: str) -> None:
        if tuple(src.shape) != (rows, m.in_features):
            raise _shape_error(fname, name, src.shape, (rows, m.in_features))
        m.set_weight(src, off)
    return load


def _scale_rows(m: Fp8Linear, name: str, off: int, rows: int) -> Loader:
    s = m.scheme

    def load(src: torch.Tensor, fname: str) -> None:
        src = src.float()
        if s.weights == "block":
            bn, bk = s.block
            want = (-(-rows // bn), m.weight_scale.shape[1])
            if tuple(src.shape) != want:
                raise _shape_error(fname, name, src.shape, want)
            m.weight_scale[off // bn:off // bn + want[0]].copy_(src)
        elif s.weights == "channel":
            if src.numel() != rows:
                raise _shape_error(fname, name, src.shape, (rows, 1))
            m.weight_scale[off:off + rows].copy_(src.reshape(rows))
        else:   # one scale for the tensor: every row of this part
            if src.numel() != 1:
                raise _shape_error(fname, name, src.shape, ())
            m.weight_scale[off:off + rows].fill_(src.reshape(()).item())
    return load


def _input_scale(m: Fp8Linear, name: str) -> Loader:
    def load(src: torch.Tensor, fname: str) -> None:
        if src.numel() != 1:
            raise _shape_error(fname, name, src.shape, ())
        torch.maximum(m.input_scale, src.float().reshape(1).to(m.input_scale.device), out=m.input_scale)
    return load


def _kv_scale(layer, kind: str, name: str) -> Loader:
    def load(src: torch.Tensor, fname: str) -> None:
        if src.numel() != 1:
            raise EngineError(f"{fname}: {name} must hold one scale (per-tensor), it has shape "
                              f"{tuple(src.shape)}")
        value = float(src.float().reshape(()))
        if not value > 0:
            raise EngineError(f"{fname}: {name} is {value}; a KV scale must be positive")
        setattr(layer, f"{kind}_scale", value)
    return load


@torch.inference_mode()
def init_dummy_fp8(model, generator: torch.Generator) -> None:
    """Random N(0, 0.02) weights quantized into each Fp8Linear (one matrix at a time,
    so the float copy never holds more than one projection)."""
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            w = torch.empty(m.out_features, m.in_features, dtype=torch.bfloat16, device=m.weight.device)
            w.normal_(0.0, 0.02, generator=generator)
            m.set_weight(w)
            if m.input_scale is not None:
                m.input_scale.fill_(0.02 * 4 / 448)
