"""All-reduce cost of tensor parallelism, through the engine's own parallel.TPGroup.

    python3 gpu/tp_allreduce.py OUT.json [--hidden 8192] [--world 2] [--device cuda|cpu]

Per decode batch size B: one all-reduce of [B, hidden] bf16 (two per layer: o and down),
timed eagerly and replayed from a CUDA graph of 100 of them (as the decode graphs run
them); bytes / time against the GPU-to-GPU link. Then one 256 MiB all-reduce: the bus
bandwidth NCCL reaches (2 (N-1)/N x bytes / time), to compare with the link's ~400 GB/s.
On the CPU (gloo, tiny sizes) it only proves the script end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = (1, 8, 64, 256)


def _time(fn, iters: int, cuda: bool) -> float:
    """Seconds per call."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def rank_main(rank: int, world: int, port: int, a, out: str) -> None:
    from zerod.engine.tp.parallel import TPGroup

    cuda = a.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    tp = TPGroup(rank, world, dev, f"tcp://127.0.0.1:{port}")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for B in BATCHES:
        x = torch.randn(B, a.hidden, dtype=dtype, device=dev)
        eager = _time(lambda: tp.all_reduce(x), a.iters, cuda)
        graph = None
        if cuda:
            n = 100
            g = torch.cuda.CUDAGraph()
            tp.all_reduce(x)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(n):
                    tp.all_reduce(x)
            graph = _time(g.replay, max(a.iters // n, 5), cuda) / n
        nbytes = x.numel() * x.element_size()
        rows.append(dict(batch=B, bytes=nbytes, eager_us=eager * 1e6,
                         graph_us=graph * 1e6 if graph else None,
                         per_layer_us=2 * (graph or eager) * 1e6))
    big = torch.empty((a.big_mib << 20) // 2, dtype=dtype, device=dev)
    t = _time(lambda: tp.all_reduce(big), 10, cuda)
    nbytes = big.numel() * big.element_size()
    bus = 2 * (world - 1) / world * nbytes / t / 1e9
    if rank == 0:
        Path(out).write_text(json.dumps(dict(world=world, hidden=a.hidden, device=a.device,
                                             decode=rows, big_bytes=nbytes, big_ms=t * 1e3,
                                             bus_GBps=bus), indent=2))
    tp.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--big-mib", type=int, default=256)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.spawn(rank_main, args=(a.world, port, a, a.out), nprocs=a.world, join=True)
    doc = json.loads(Path(a.out).read_text())
    print(f"all-reduce of [B, {a.hidden}] over {a.world} ranks ({a.device}):")
    print(f"{'B':>5} {'bytes':>9} {'eager us':>9} {'graph us':>9} {'per layer us':>13}")
    for r in doc["decode"]:
        g = f"{r['graph_us']:.1f}" if r["graph_us"] else "-"
        print(f"{r['batch']:>5} {r['bytes']:>9} {r['eager_us']:>9.1f} {g:>9} {r['per_layer_us']:>13.1f}")
    print(f"{doc['big_bytes'] >> 20} MiB all-reduce: {doc['big_ms']:.2f} ms, bus {doc['bus_GBps']:.1f} GB/s")


if __name__ == "__main__":
    main()
