"""The independent measurement beside `zerod diag` (gpu/diag_check.sh): a
device-to-device copy and a bf16 matmul through plain torch, timed with
torch.cuda.Event, nothing of zerod imported. Prints one JSON object per GPU."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
import torch  # noqa: E402


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1000 / iters


def main() -> None:
    gpus = [int(g) for g in sys.argv[1].split(",")] if len(sys.argv) > 1 else range(torch.cuda.device_count())
    for gpu in gpus:
        with torch.cuda.device(gpu):
            n = (2 << 30) // 2  # 2 GiB of bf16
            src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            copy_s = timed(lambda: dst.copy_(src), 20)
            del src, dst
            m = 8192
            a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
            b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
            mm_s = timed(lambda: a @ b, 50)
            print(json.dumps({"gpu": gpu, "name": torch.cuda.get_device_name(gpu),
                              "copy_gb_s": round(2 * 2 * n / copy_s / 1e9, 1),  # read + write
                              "bf16_matmul_tflops": round(2 * m ** 3 / mm_s / 1e12, 1),
                              "torch": torch.__version__}), flush=True)
            del a, b
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
