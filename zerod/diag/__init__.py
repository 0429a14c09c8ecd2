"""`zerod diag`: active GPU tests (a CUDA context, HBM bandwidth, bf16/FP8 GEMM
checked against a reference, host<->device and peer bandwidth, the health
counters before and after), in doctor's report shape.

    catalogue.py   the test IDs, titles, levels and fixes (docs/checks.md)
    report.py      one test's result and the report (exit code as doctor's)
    judge.py       measured against expected: the verdict of a figure
    nvml_health.py the NVML counters and kernel-log Xids read before and after
    gpu_tests.py   the tests themselves (torch, imported only when they run)
    runner.py      levels, GPU selection, a host without a GPU
    busy.py        which engines serve on which GPUs (the daemon's control API)
    store.py       the last result, kept under the state directory
"""
