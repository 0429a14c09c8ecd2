"""Kernels of the engine: Triton on CUDA, with plain-torch references.

`CUDA_KERNELS` maps an op name of `zerod.engine.model.ops` to a Triton implementation
with the identical signature; ops.py calls it when its tensors are on CUDA.
It is empty where Triton or CUDA is missing (CI, a laptop), or when the
environment sets ZEROD_DISABLE_TRITON=1 (to A/B the torch path on a GPU).

Every kernel here is graph-capturable: no host synchronisation, outputs and
workspaces sized from shapes only, grids fixed by shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rope",
    "silu_and_mul",
    "write_kv",
    "rope_write_kv",
    "decode_attention",
    "prefill_attention",
)

IMPORT_ERROR: str | None = None


def load_kernels() -> dict:
    """Import the Triton kernels; raises ImportError where Triton is missing.

    Works without CUDA too (Triton's interpreter, TRITON_INTERPRET=1, runs them
    on CPU tensors; the CPU tests use that).
    """
    from .activation import silu_and_mul
    from .decode_attention import decode_attention
    from .kv_cache import write_kv
    from .norm import fused_add_rms_norm, rms_norm
    from .prefill_attention import prefill_attention
    from .rope import apply_rope, rope_write_kv

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "apply_rope": apply_rope,
        "silu_and_mul": silu_and_mul,
        "write_kv": write_kv,
        "rope_write_kv": rope_write_kv,
        "decode_attention": decode_attention,
        "prefill_attention": prefill_attention,
    }


def device_file(folder: Path, device_name: str) -> Path:
    """A tuned table of one device model in folder (moe_configs/, skinny_configs/): the
    CUDA device's name, spaces as underscores ("NVIDIA H200" -> NVIDIA_H200.json)."""
    return folder / f"{device_name.replace(' ', '_')}.json"


def _build() -> dict:
    global IMPORT_ERROR
    if os.environ.get("ZEROD_DISABLE_TRITON", "") not in ("", "0"):
        IMPORT_ERROR = "disabled by ZEROD_DISABLE_TRITON"
        return {}
    try:
        import torch

        if not torch.cuda.is_available():
            IMPORT_ERROR = "CUDA is not available"
            return {}
        return load_kernels()
    except Exception as exc:  # ImportError, or a broken Triton/driver install
        IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        return {}


CUDA_KERNELS: dict = _build()

__all__ = ["CUDA_KERNELS", "KERNEL_NAMES", "IMPORT_ERROR", "device_file", "load_kernels"]
