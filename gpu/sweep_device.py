"""The device side of a kernel sweep (gpu/skinny_gemm_bench.py, gpu/moe_tune.py): the GPU,
or with `interpret` the CPU through Triton's interpreter (fp16 there: its tl.dot on bf16
is wrong), float32 references kept float32."""

from __future__ import annotations

import os
import sys


def sweep_device(interpret: bool):
    """(torch, the device, the half dtype), or None (said on stderr) where no GPU is."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton defines any kernel
    import torch

    if interpret:
        from kernel_checks import patch_triton_interpreter
        patch_triton_interpreter()
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --interpret for the CPU dry run", file=sys.stderr)
        return None
    torch.backends.cuda.matmul.allow_tf32 = False   # the float32 references stay float32
    return torch, torch.device("cpu" if interpret else "cuda"), torch.float16 if interpret else torch.bfloat16


def machine(torch, dev, interpret: bool) -> dict:
    """What a sweep's results record of where they ran."""
    import triton

    return {"device": "cpu (Triton interpreter)" if interpret else torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "triton": triton.__version__, "interpret": interpret}
