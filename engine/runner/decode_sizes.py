"""The batch sizes decode CUDA graphs are captured for, placed by measured cost.

A decode step of B requests replays the smallest captured graph of at least B rows, so
its cost is that graph's. cuBLAS picks its GEMM kernels per shape, and on the H200 its
time is not monotone in the rows: the 8B shape's projections take 153 us a layer at 200
rows, 180 at 224 and 176 at 256 in bf16, while in FP8 256 rows are the cheapest of the
three (gpu/results/kernels.md, "Skinny GEMMs against cuBLAS"). The fixed ladder
(graph_buckets below) pads 200 streams to 224, the dearest of them in bf16.

With Tuning.decode_graphs_by_cost = N, the runner times the model's projections at every
multiple of 8 up to the largest batch (one pass over all layers each, so the weights come
from HBM as in a step, replayed from a CUDA graph so that the device's time is what is
timed) and captures N graphs where they cost least: a size that a larger one undercuts is
never worth a graph, and among the rest the sizes that minimise the summed cost of every
batch size from 1 to the largest (each padded to the next graph).
"""

from __future__ import annotations

import time

import torch

# A size is dropped when a larger one costs less by more than this share (measurement
# noise between near-equal sizes must not drop the small ones).
UNDERCUT = 0.03
SMALL = (1, 2, 4, 8)      # always captured: batch-1's own kernel specialisations, cheap graphs


def graph_buckets(max_bs: int) -> list[int]:
    """The fixed ladder: 1, 2, 4, 8, then by 16 to 128, then by 32, and max_bs."""
    out = [b for b in SMALL if b <= max_bs]
    b = 16
    while b <= max_bs:
        out.append(b)
        b += 16 if b < 128 else 32
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


def candidates(max_bs: int) -> list[int]:
    """The sizes whose cost is measured: the small ones, every multiple of 8 from 16, max_bs."""
    out = [b for b in SMALL if b <= max_bs] + list(range(16, max_bs, 8))
    return out + [max_bs] if not out or out[-1] != max_bs else out


def choose(costs: dict[int, float], count: int) -> list[int]:
    """`count` graph sizes (at least the small ones and the largest) from measured
    `costs` (size -> seconds or any unit), sorted; every batch size up to the largest fits one."""
    sizes = sorted(costs)
    top = sizes[-1]
    forced = {b for b in SMALL if b in costs} | {top}
    # a size undercut by a larger one: every batch it would take, the larger takes cheaper
    kept = [b for i, b in enumerate(sizes)
            if b in forced or all(costs[c] >= costs[b] * (1 - UNDERCUT) for c in sizes[i + 1:])]
    free = max(0, count - len(forced))
    pool = [b for b in kept if b not in forced]
    if len(pool) <= free:
        return sorted(forced | set(pool))
    # dynamic programme over the kept sizes in order: best[j][m] = the least summed cost of
    # the batch sizes up to kept[j], with kept[j] chosen and m free sizes chosen up to it
    n, inf = len(kept), float("inf")
    best = [[inf] * (free + 1) for _ in range(n)]
    back: list[list[int | None]] = [[None] * (free + 1) for _ in range(n)]
    for j, b in enumerate(kept):
        own = 0 if b in forced else 1
        if own <= free and not forced.intersection(kept[:j]):   # b the first chosen
            best[j][own] = b * costs[b]
        for i in range(j):
            if forced.intersection(kept[i + 1:j]):   # i then j would skip a forced size
                continue
            for m in range(free + 1 - own):
                v = best[i][m] + (b - kept[i]) * costs[b]   # batches kept[i]+1 .. b pad to b
                if v < best[j][m + own]:
                    best[j][m + own], back[j][m + own] = v, i
    m = min(range(free + 1), key=lambda k: best[n - 1][k])   # the largest is always chosen
    out, j = [], n - 1
    while j is not None:
        out.append(kept[j])
        j, m = back[j][m], m - (kept[j] not in forced)
    return sorted(out)


@torch.inference_mode()
def probe(model, sizes: list[int], device: torch.device) -> dict[int, float]:
    """Seconds of the model's projections (every layer's, the experts of a mixture, the
    LM head) at each row count, as a decode step of that many rows runs them."""
    mc = model.mc
    dtype = model.dtype
    widest = max(sizes)
    xh = torch.randn(widest, mc.hidden_size, dtype=dtype, device=device) * 0.1
    xq = torch.randn(widest, mc.q_size, dtype=dtype, device=device) * 0.1
    xi = (torch.randn(widest, mc.intermediate_size, dtype=dtype, device=device) * 0.1
          if any(L.moe is None for L in model.layers) else None)

    def step(m: int) -> None:
        for L in model.layers:
            L.qkv(xh[:m])
            L.o(xq[:m])
            if L.moe is not None:
                L.moe(xh[:m], model.act)
            else:
                L.gate_up(xh[:m])
                L.down(xi[:m])
        model.lm_head(xh[:m])

    out = {}
    for m in sizes:
        step(m)     # the first call of each shape picks its kernels; not timed
        out[m] = _graph_seconds(step, m) if device.type == "cuda" else _eager_seconds(step, m)
    return out


def _eager_seconds(step, m: int) -> float:
    t0 = time.perf_counter()
    step(m)
    return time.perf_counter() - t0


def _graph_seconds(step, m: int, replays: int = 3) -> float:
    """The median of a few replays of the pass captured in a CUDA graph: the device's time
    alone, as a decode graph runs it. Timed eagerly, an FP8 pass is host-bound (each GEMM's
    quantization and scaling launches outrun the kernels), so its costs would not say which
    size the GPU runs fastest."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(m)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del g
    return sorted(times)[len(times) // 2]


def decode_sizes(runner, max_bs: int) -> tuple[list[int], dict[int, float] | None]:
    """The decode graphs' batch sizes for this runner, and the costs measured to place them
    (None: the fixed ladder, the tuning's default and the only choice under tensor
    parallelism, whose ranks must all capture the same sizes)."""
    count = runner.tuning.decode_graphs_by_cost
    if not count or runner.model.tp is not None:
        return graph_buckets(max_bs), None
    costs = probe(runner.model, candidates(max_bs), runner.device)
    return choose(costs, count), costs
