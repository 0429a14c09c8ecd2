"""A stand-in for a monitoring agent on the GPU (gpu/daemon.sh doctor starts it).

python3 gpu/doctor_agent.py NAME alloc GIB   # takes GIB of GPU memory (a CUDA context)
python3 gpu/doctor_agent.py NAME nvml        # only nvmlInit, as monitoring agents do

The process renames itself (prctl PR_SET_NAME, so /proc/PID/comm reads NAME; the
caller's `exec -a NAME` sets argv[0]) so that it looks like the real agent.
"""
import ctypes
import sys
import time

name, mode = sys.argv[1], sys.argv[2]
ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
if mode == "alloc":
    import torch

    x = torch.empty(int(float(sys.argv[3]) * (1 << 30)), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
else:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
print("ready", flush=True)
deadline = time.time() + 180
while time.time() < deadline:
    if mode == "nvml":
        pynvml.nvmlDeviceGetUtilizationRates(h)  # poll like an agent does
    time.sleep(1)
