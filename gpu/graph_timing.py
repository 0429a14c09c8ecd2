"""The device time of one CUDA graph replay: the median over `reps` replays, each between
two CUDA events (the device scripts' one way to time a captured graph)."""

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
