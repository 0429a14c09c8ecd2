"""A rogue GPU job for the latency evidence (gpu/daemon.sh latency): holds GIB of GPU memory
and runs bf16 matmuls in a loop, as a stray training or benchmark job would, for SECONDS.

    python3 gpu/rogue_job.py [GIB] [SECONDS]
"""
import ctypes
import sys
import time

import torch

gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
ctypes.CDLL(None).prctl(15, b"trainer", 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm reads "trainer"
hold = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
print("ready", flush=True)
end = time.time() + seconds
while time.time() < end:
    for _ in range(10):
        a = (a @ b).clamp_(-1, 1)
    torch.cuda.synchronize()
