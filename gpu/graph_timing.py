"""The device time of one CUDA graph replay: the median over `reps` replays, each between
two CUDA events (the device scripts' one way to time a captured graph); and the graph of
an op called back to back, as a captured decode step launches it."""

from __future__ import annotations

import statistics


def replay_ms(torch, g, reps: int) -> float:
    """torch: the module (the sweep's tests pass a stand-in for torch.cuda)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def capture_calls(torch, fn, calls: int, warmups: int = 2):
    """A CUDA graph of `calls` fn() calls back to back (launch gaps as in a captured step),
    fn run `warmups` times on a side stream first so nothing compiles while capturing."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g
