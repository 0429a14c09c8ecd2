"""One PEFT LoRA adapter read from disk and checked against the base model.

PEFT writes `adapter_config.json` and `adapter_model.safetensors` (tensors named
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, A [r, in], B [out, r]).
What the engine serves: plain LoRA on any of the decoder's projections (q/k/v/o/gate/up/
down, and Phi-3's fused qkv_proj / gate_up_proj), scaled by `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with rslora). Anything else is refused with a LoraError that names
it, before a byte reaches the device: DoRA, embedding or lm_head targets, modules saved
whole, biases, per-module rank / alpha patterns, a rank above --max-lora-rank, tensors the
model has no place for or whose shapes do not match it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EngineError
from ..spec.hf_config import ModelConfig


class LoraError(EngineError):
    """An adapter the engine cannot serve; the message names the adapter and why."""


# HF module name -> (our fused projection, the HF modules it covers, in output order)
MODULES = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "gate_up_proj": "gate_up",
    "down_proj": "down",
}

_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_EMBEDDING = re.compile(r"(lora_embedding_[AB]|embed_tokens|lm_head)")

_uids = itertools.count(1)

# An adapter is read from a path a client names (/v1/load_lora_adapter), so every read is
# bounded: adapter_config.json is a few hundred bytes, nested a few levels.
MAX_CONFIG_BYTES = 64 * 1024
MAX_CONFIG_DEPTH = 16
# The weights file holds at most A and B of every projection of every layer at the rank
# the config says, in fp32 (what PEFT saves), twice over for slack, plus its JSON header.
WEIGHTS_SLACK_BYTES = 8 << 20


def _regular_file(d: Path, f: Path, name: str, max_bytes: int) -> bytes:
    """The bytes of adapter file `f`, at most `max_bytes`, read only if it is a regular file
    inside the adapter directory `d` (or, for a Hugging Face cache snapshot, its repo's
    blobs): never a FIFO, a device or a link leading elsewhere, which could block the
    reading thread forever or feed it without end."""
    real, home = os.path.realpath(f), os.path.realpath(d)
    allowed = [home]
    if os.path.basename(os.path.dirname(home)) == "snapshots":   # models--org--name/snapshots/REV
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(home)), "blobs"))
    if not any(real == a or real.startswith(a + os.sep) for a in allowed):
        raise LoraError(f"LoRA adapter {name!r}: {f} leads to {real}, outside the adapter "
                        "directory")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot open {f} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoraError(f"LoRA adapter {name!r}: {f} is not a regular file")
        if st.st_size > max_bytes:
            raise LoraError(f"LoRA adapter {name!r}: {f} is {st.st_size} bytes, more than the "
                            f"{max_bytes} this adapter's config allows")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise LoraError(f"LoRA adapter {name!r}: {f} grew past {max_bytes} bytes while read")
    return data


def _too_deep(obj: object, limit: int) -> bool:
    stack = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(o, (dict, list)):
            stack.extend((c, depth + 1) for c in (o.values() if isinstance(o, dict) else o))
    return False


@dataclass(eq=False)
class LoraAdapter:
    """A registered adapter. `weights` maps (layer, HF module) to (A [r, in], B [out, r])
    on the host, B already multiplied by the scale; None while the host LRU holds no copy
    (read again from `path` when needed). `uid` tells apart two adapters loaded under one
    name one after the other (prefix-cache roots, device slots)."""
    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None
    base_model_name: str | None = None
    uid: int = field(default_factory=lambda: next(_uids))


def _shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each HF module the model has."""
    h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "qkv_proj": (h, q + 2 * kv),
            "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h)}


def _config(d: Path, name: str, max_rank: int) -> tuple[int, float]:
    """(rank, scale) from adapter_config.json, refusing what is not plain LoRA."""
    f = d / "adapter_config.json"
    try:
        raw = _regular_file(d, f, name, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter {name!r}: {f} does not exist (a PEFT adapter directory "
                        "holds adapter_config.json and adapter_model.safetensors)") from None
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {f} "
                        f"({exc if isinstance(exc, ValueError) else 'nested too deeply'})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {f} is not a JSON object")
    if _too_deep(cfg, MAX_CONFIG_DEPTH):
        raise LoraError(f"LoRA adapter {name!r}: {f} is nested deeper than {MAX_CONFIG_DEPTH} levels")

    def refuse(what: str) -> None:
        raise LoraError(f"LoRA adapter {name!r}: {what} is not supported")

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse("DoRA (use_dora)")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg.get('bias')!r} (only 'none')")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg['modules_to_save']!r} (whole modules saved with the adapter)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            refuse(f"{key} (per-module ranks or alphas)")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    for t in targets:
        if _EMBEDDING.search(str(t)):
            refuse(f"target module {t!r} (embedding and lm_head adapters)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)   # PEFT's default alpha
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {name!r}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha must be a finite number, got {alpha!r}")
    if r > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {r} is above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    if not math.isfinite(scale):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha / r = {scale} is not finite")
    return r, scale


def read_adapter(name: str, path: str | Path, mc: ModelConfig, max_rank: int,
                 base_model_name: str | None = None) -> LoraAdapter:
    """Read and check the PEFT adapter in directory `path` for the model `mc`."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {d} is not a directory")
    rank, scale = _config(d, name, max_rank)
    return LoraAdapter(name, str(d), rank, scale, read_weights(name, d, mc, rank, scale),
                       base_model_name)


def read_weights(name: str, d: Path, mc: ModelConfig, rank: int,
                 scale: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load as load_safetensors

    f = Path(d) / "adapter_model.safetensors"
    shapes = _shapes(mc)
    most = 2 * 4 * rank * sum(i + o for i, o in shapes.values()) * mc.num_layers + WEIGHTS_SLACK_BYTES
    try:
        raw = _regular_file(Path(d), f, name, most)
    except FileNotFoundError:
        extra = " (only PyTorch .bin found; zerod reads safetensors)" if (Path(d) / "adapter_model.bin").exists() else ""
        raise LoraError(f"LoRA adapter {name!r}: {f} does not exist{extra}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = load_safetensors(raw)
        del raw
        for key in list(tensors):
            if "lora_magnitude_vector" in key:
                raise LoraError(f"LoRA adapter {name!r}: DoRA (tensor {key}) is not supported")
            if _EMBEDDING.search(key):
                raise LoraError(f"LoRA adapter {name!r}: embedding and lm_head adapters are "
                                f"not supported (tensor {key})")
            m = _TENSOR.match(key)
            if m is None or m.group(2) not in shapes:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key} targets a module "
                                "this model has no LoRA place for (q/k/v/o/gate/up/down_proj)")
            layer, module, half = int(m.group(1)), m.group(2), m.group(3)
            if layer >= mc.num_layers:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key} is for layer {layer}, "
                                f"the model has {mc.num_layers}")
            halves.setdefault((layer, module), {})[half] = tensors.pop(key)
    except LoraError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        raise LoraError(f"LoRA adapter {name!r}: cannot read {f} ({type(exc).__name__}: {exc})") from None
    if not halves:
        raise LoraError(f"LoRA adapter {name!r}: {f} holds no LoRA tensors")
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} "
                            "but not its other half")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[module]
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} "
                            f"and B {tuple(b.shape)}; rank {rank} on this model needs "
                            f"A {(rank, n_in)} and B {(n_out, rank)}")
        a, b = a.float(), b.float() * scale
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} holds NaN or Inf "
                            "weights (or they overflow at lora_alpha / r)")
        weights[(layer, module)] = (a, b)
    return weights
