"""What LoRA adds to an eager forward (the prefill chunks and mixed steps a busy server runs
outside CUDA graphs): host launch time and device time of the engine's own forward on the
8B shape (dummy weights, --enable-lora --max-loras 8, rank-16 slabs filled at random), for
prompt chunks of 24 tokens x 1, 8 and 85 sequences, base rows vs rows spread over the 8
adapters; then the host cost of single launches (a projection's
product, the expand, the rows' grouping, a Triton kernel of the base model for scale).
Medians of REPS runs.

    python3 gpu/lora_eager_bench.py MODEL_DIR [OUT.json]    (SMOKE=1: CPU, tiny shape)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # zerod from the checkout
SMOKE = os.environ.get("SMOKE", "0") == "1"
REPS = 3 if SMOKE else 15
SLOTS = 9


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev) -> tuple[float, float]:
    """(host ms to launch fn, ms until the device finished it), medians of REPS."""
    host, total = [], []
    for _ in range(REPS):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(dev)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(host), statistics.median(total)


def per_call_us(fn, dev, n: int = 200) -> float:
    """Host microseconds per call of fn, n calls back to back (the device may lag)."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync(dev)
    return (t1 - t0) * 1e6 / n


def main() -> None:
    from zerod.engine.model import ops
    from zerod.engine.config import EngineConfig
    from zerod.engine.core.engine import build_rank
    from zerod.engine.model.decoder import AttnMeta

    model_dir = Path(sys.argv[1])
    cfg = EngineConfig(model=str(model_dir), load_format="dummy", enable_lora=True, max_loras=SLOTS - 1,
                       max_lora_rank=16, max_model_len=1024, kv_pages=4096,
                       dtype="float32" if SMOKE else "bfloat16", device="cpu" if SMOKE else "cuda")
    dev = torch.device(cfg.device)
    runner, loras = build_rank(cfg, model_dir, dev, None)
    g = torch.Generator(device=dev).manual_seed(0)
    for L in runner.model.layers:   # every adapter slot filled (slot 0 stays zero)
        for proj in ("qkv", "o", "gate_up", "down"):
            p = getattr(L, proj).lora
            p.A[1:].copy_((torch.randn(p.A[1:].shape, device=dev, generator=g) * 0.02).to(p.A.dtype))
            p.B[1:].copy_((torch.randn(p.B[1:].shape, device=dev, generator=g) * 0.02).to(p.B.dtype))
    ps = runner.ps
    rows = []
    for n_seqs, Lq in ((1, 24), (8, 24), (85, 24)):
        T = n_seqs * Lq
        pos = torch.arange(0, Lq, dtype=torch.int64, device=dev).repeat(n_seqs)
        meta = AttnMeta(slot_mapping=pos % ps,
                        block_tables=torch.zeros(n_seqs, (Lq + ps - 1) // ps, dtype=torch.int32, device=dev),
                        context_lens=torch.full((n_seqs,), Lq, dtype=torch.int32, device=dev),
                        cu_seqlens_q=torch.arange(0, T + 1, Lq, dtype=torch.int32, device=dev),
                        no_prefix=True, seqlens_q=[Lq] * n_seqs)
        toks = torch.zeros(T, dtype=torch.int64, device=dev)
        slots = (torch.arange(n_seqs, device=dev) % (SLOTS - 1) + 1).int().repeat_interleave(Lq)
        r = dict(seqs=n_seqs, tokens=T)
        for way, lora_rows in (("base", None), ("lora", slots)):
            def fwd():
                return runner._forward(toks, pos, meta, lora_rows)
            fwd()   # compiled already by the warm-up; once more for the allocator
            r[f"{way}_host_ms"], r[f"{way}_total_ms"] = timed(fwd, dev)
        rows.append(r)
        print(json.dumps(r), flush=True)
    # single launches, host cost (x: 24 rows at the 8B shape; the qkv projection)
    L0 = runner.model.layers[0]
    lin = L0.qkv
    x = torch.randn(24, lin.in_features, device=dev, generator=g).to(lin.weight.dtype)
    idx = (torch.arange(24, device=dev) % (SLOTS - 1) + 1).int()
    loras.batch.set(idx, grouped=dev.type == "cuda")
    single = {
        "F.linear (base qkv)": lambda: F.linear(x, lin.weight),
        "F.linear (qkv with the A rows)": lambda: F.linear(x, lin.lora.weight),
        "LoraProjection (qkv, whole)": lambda: lin(x),
        "rms_norm (a base-model Triton kernel)": lambda: ops.rms_norm(x, L0.input_norm, 1e-5),
    }
    if dev.type == "cuda":
        from zerod.engine.kernels import lora as k
        y = F.linear(x, lin.lora.weight)
        n = sum(lin.lora.segments)
        xa = y[:, n:n + lin.lora.A.shape[0] * lin.lora.A.shape[1]]
        single["lora_expand_slots"] = lambda: k.lora_expand_slots(y[:, :n], xa, lin.lora.B, lin.lora.segments,
                                                                  loras.batch.groups)
        single["group_rows"] = lambda: k.group_rows(idx, SLOTS)
    costs = {name: per_call_us(fn, dev) for name, fn in single.items()}
    loras.batch.clear()
    print("\neager forward over 8 adapters (prompt chunks of 24 tokens): host launch / until done, ms (medians)")
    print(f"{'seqs':>5} {'tokens':>6}   {'base host':>9} {'lora host':>9}   {'base done':>9} {'lora done':>9}")
    for r in rows:
        print(f"{r['seqs']:5d} {r['tokens']:6d}   " + " ".join(f"{r[w + '_host_ms']:9.2f}" for w in ("base", "lora"))
              + "   " + " ".join(f"{r[w + '_total_ms']:9.2f}" for w in ("base", "lora")))
    print("\nhost microseconds per launch")
    for name, us in costs.items():
        print(f"  {name:40s} {us:8.1f}")
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps({"forwards": rows, "launch_us": costs}, indent=1))


if __name__ == "__main__":
    main()
