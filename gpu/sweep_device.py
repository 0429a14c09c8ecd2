"""The device side of a kernel sweep (gpu/skinny_gemm_bench.py, gpu/moe_tune.py): the GPU,
or with `interpret` the CPU through Triton's interpreter (fp16 there: its tl.dot on bf16
is wrong), float32 references kept float32; and the sweep's JSON as it goes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


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


class SweepResult:
    """A sweep's JSON ({"info", "rows", "stopped_early", ...}), written after every cell so a
    call cut short keeps what it measured, with its --budget-s and a failed CUDA context
    each ending it early and saying so."""

    def __init__(self, path: str, info: dict, budget_s: float, **more):
        self.path = Path(path)
        self.budget_s = budget_s
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.doc = {"info": info, "rows": self.rows, "stopped_early": False, **more}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        """Past --budget-s: no new cell is started (recorded as stopped_early)."""
        if self.elapsed() > self.budget_s:
            self.doc["stopped_early"] = True
        return self.doc["stopped_early"]

    def save(self) -> None:
        self.doc["elapsed_s"] = self.elapsed()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.doc, indent=1))

    def finish(self, fatal: str | None) -> None:
        """Why it stopped early, if it did, in the console and the JSON; saved."""
        if self.doc["stopped_early"]:
            print(f"stopped early: past --budget-s {self.budget_s:.0f} s, the rest not measured", flush=True)
        if fatal:
            self.doc["fatal"] = fatal
            print(f"stopped: the CUDA context failed ({fatal}); rows before it are kept", flush=True)
        self.save()
