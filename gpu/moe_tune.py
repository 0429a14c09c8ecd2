#!/usr/bin/env python3
"""Tile configs of the fused MoE kernel (engine/kernels/moe.py) tuned on one GPU: per
model shape and token count T, the fastest config of each of its two grouped GEMMs, as a
table the engine loads (engine/kernels/moe_configs/<device name, spaces as _>.json).

    python3 gpu/moe_tune.py --out $OUT/moe.json --table-out $OUT/moe_table.json   # the sweep
    python3 gpu/moe_tune.py --interpret --out /tmp/m.json                           # dry run on the CPU

then, from the returned files: cp moe_table.json engine/kernels/moe_configs/NVIDIA_H200.json

Shapes (`--models`): Mixtral-8x7B (E 8, top-2, H 4096, I 14336: w13 [8, 28672, 4096],
w2 [8, 4096, 14336]) and a Qwen3-30B-A3B-like one (E 128, top-8, H 2048, I 768), bf16.
T: the engine's decode graph buckets up to 256 (engine/runner/decode_sizes.py graph_buckets) and
a prefill of 2048; tokens routed to k distinct uniformly random experts, from a fixed seed.
Each GEMM is measured as fused_experts runs it: w13 on the aligned pairs, w2 with the
routing weights and the sum over each token's k pairs (and split-K's partials).

Candidates: BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K 64-256, 4 or 8 warps, 2-5 stages,
pruned (`candidates`) to 125; at each T only the BLOCK_M around the pairs per expert
(`block_ms`), and the current `_config` choice always. One alignment serves both GEMMs in
fused_experts, so one BLOCK_M per T: the one whose best w13 plus best w2 is fastest. The
six fastest w2 configs are then tried with SPLIT_K 2, 4 and 8 (decode T only).

Each candidate is first checked against a float32 reference (skinny_gemm_bench's
`measure` and TOL: a wrong or failed config is never picked), then timed in a CUDA graph
over weight copies (skinny_gemm_bench's COLD_BYTES: the experts a call touches come from
HBM, not the L2), the median of 5 replays of ~0.5 ms (gpu/graph_timing.py), per call.
Bounds: max(bytes / HBM, FLOPs / peak) (gpu/step_breakdown.py's H200 figures), the bytes
those of the experts the routing touches, the activations read and the output written.
Per model and T the whole layer (fused_experts: alignment, both GEMMs, activation, sum)
is also timed with the current tiles and with the tuned ones, and checked.

Writes every row to --out and the table to --table-out after each (model, T) cell, so a
run cut short keeps what it measured; --budget-s (default 220) starts no cell past it.

Runtime on an H200 (estimated, not yet measured): 34 cells (Mixtral's 17 first, T 256 to
160, the 200-stream range, first of each model), 5,500 timings in all (56-103 configs a
GEMM a cell, up to 18 split-K ones, 2 layers), each a check and a graph of 5-30 ms:
~2 minutes. Compiles: 375 GEMM kernels (125 configs for each model's w13, w2's shared by
both) and the split ones, ~0.25 s each on one core, on a thread per core (Triton's
AsyncCompileMode) before each cell's timings: 0.5-2 minutes. About 3-4 minutes in all:
one device call of 5 minutes, the budget's cut included.

--interpret: TRITON_INTERPRET=1, tiny shapes and a tiny grid on the CPU, fp16 in place of
bf16 (the interpreter's tl.dot on bf16 is wrong) and its wall-clock, to exercise the
script end to end; its times and table say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from step_breakdown import HBM, PEAK  # noqa: E402  (H200: diag's copy bandwidth, GEMM peaks)
from graph_timing import replay_ms  # noqa: E402
from sweep_device import SweepResult, machine, sweep_device  # noqa: E402
from skinny_gemm_bench import COLD_BYTES, MAX_COPIES, TOL, measure  # noqa: E402

MODELS = {"mixtral": dict(E=8, top_k=2, H=4096, I=14336), "qwen3_moe": dict(E=128, top_k=8, H=2048, I=768)}
# tiny stand-ins for --interpret: K past a tile and ragged (48, 24), a few pairs per expert
INTERPRET_MODELS = {"mixtral": dict(E=8, top_k=2, H=64, I=48), "qwen3_moe": dict(E=16, top_k=4, H=32, I=24)}
DECODE_MAX = 256     # the largest decode bucket tuned (the 200-stream scenario's steps)
PREFILL_T = 2048
INTERPRET_TS = (1, 33)
PRIORITY_FROM = 160  # T from here to DECODE_MAX first: the 200-stream range
GRID = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128, 256), BLOCK_K=(64, 128, 256),
            num_warps=(4, 8), num_stages=(2, 3, 4, 5))
INTERPRET_GRID = dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), BLOCK_K=(16, 32), num_warps=(4,), num_stages=(2,))
SMEM_MAX = 200 << 10    # bytes of shared memory a config may plan (an H200 block gets 227 KB)
SPLITS = (2, 4, 8)
SPLIT_TOP = 6           # the fastest unsplit w2 configs tried with each split
SPLIT_MIN_STEPS = 4     # BLOCK_K steps each split keeps, so the loads still pipeline
TARGET_MS, REPS = 0.5, 5   # a replay's length and the replays timed (thousands of timings a run)
SEED = 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "moe.json"),
                    help="every row as JSON (default $OUT/moe.json)")
    ap.add_argument("--table-out", help="the table the engine loads (default: --out with _table)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--ts", help="comma-separated token counts (default: the decode buckets to "
                                 f"{DECODE_MAX} and {PREFILL_T})")
    ap.add_argument("--budget-s", type=float, default=220.0, help="start no new cell after this many seconds")
    ap.add_argument("--interpret", action="store_true", help="the CPU through Triton's interpreter, tiny shapes")
    a = ap.parse_args(argv)
    a.models = a.models.split(",")
    if any(m not in MODELS for m in a.models):
        ap.error(f"--models: of {','.join(MODELS)}, got {','.join(a.models)}")
    a.ts = [int(t) for t in a.ts.split(",")] if a.ts else None
    if a.table_out is None:
        p = Path(a.out)
        a.table_out = str(p.with_name(p.stem + "_table" + (p.suffix or ".json")))
    return a


# --------------------------------------------------------------------------- what is measured

def candidates(grid: dict, prune: bool = True) -> list[dict]:
    """The grid's configs, less those that cannot pay (prune: the GPU grid)."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product(*grid.values()):
        if prune and ((bm * bk + bk * bn) * 2 * stages > SMEM_MAX   # shared memory
                      or bm * bn > 4096 * warps     # > 128 float32 accumulators a thread: spills
                      or (warps == 8 and bm * bn < 4096)   # 8 warps on a small tile: idle warps
                      or (bn == 32 and bm > 32)     # thin N tiles only for decode's short M
                      or (stages == 2 and bk != 256)   # 2 stages only of 256-wide K steps
                      or (stages == 5 and bk == 256)):
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages))
    return out


def block_ms(pairs_per_expert: float, choices: tuple) -> list[int]:
    """The BLOCK_M worth trying: around the pairs an expert gets (p, half and twice it,
    p the power of two at or above the mean): smaller tiles re-read the expert's weights
    once a block, larger ones mostly multiply padding."""
    p = min(max(1 << max(0, math.ceil(pairs_per_expert) - 1).bit_length(), min(choices)), max(choices))
    return [b for b in choices if p // 2 <= b <= 2 * p]


def split_ok(k_dim: int, block_k: int, split: int, min_steps: int) -> bool:
    """Every split gets some of K (none empty), at least min_steps BLOCK_K steps."""
    from zerod.engine.kernels.moe import k_slice

    part = k_slice(k_dim, split, block_k)
    return part * (split - 1) < k_dim and part >= min_steps * block_k


def token_counts(a: argparse.Namespace) -> list[int]:
    """The T measured, in order: the 200-stream range (PRIORITY_FROM..DECODE_MAX) first,
    the smaller decode buckets next, largest first, the prefill last."""
    from zerod.engine.runner.decode_sizes import graph_buckets

    ts = a.ts or (list(INTERPRET_TS) if a.interpret else graph_buckets(DECODE_MAX) + [PREFILL_T])
    return sorted(ts, key=lambda t: (t > DECODE_MAX, t < PRIORITY_FROM, -t))


def gemm_bytes(gemm: str, m: dict, t: int, touched: int) -> int:
    """What one GEMM must move (bf16): the touched experts' weights, the activations it
    reads, the output it writes (w2: a row a token, after the sum over its pairs)."""
    e, k, h, i = m["E"], m["top_k"], m["H"], m["I"]
    if gemm == "w13":
        return 2 * (touched * 2 * i * h + t * h + t * k * 2 * i)
    return 2 * (touched * h * i + t * k * i + t * h)


def bound_us(gemm: str, m: dict, t: int, touched: int) -> float:
    flops = 2 * t * m["top_k"] * 2 * m["I"] * m["H"] / (1 if gemm == "w13" else 2)
    return 1e6 * max(gemm_bytes(gemm, m, t, touched) / HBM, flops / PEAK["bf16"])


def pick(rows: list[dict], bms: list[int]) -> tuple[int, dict, dict] | None:
    """(BLOCK_M, w13 row, w2 row): per BLOCK_M the fastest checked row of each GEMM, the
    BLOCK_M whose pair is fastest; wrong or failed rows never win."""
    best = None
    for bm in bms:
        pair = []
        for gemm in ("w13", "w2"):
            ok = [r for r in rows if r["gemm"] == gemm and r["config"]["BLOCK_M"] == bm and r.get("ok") and "us" in r]
            if not ok:
                break
            pair.append(min(ok, key=lambda r: r["us"]))
        else:
            if best is None or pair[0]["us"] + pair[1]["us"] < best[1]["us"] + best[2]["us"]:
                best = (bm, *pair)
    return best


def table_doc(info: dict, cells: list[dict], dtype: str) -> dict:
    """The table file: what the engine reads ("dtype", "configs": per weights' shape, per T)
    and, beside it, the cells."""
    configs: dict = {}
    for c in cells:
        if c.get("best"):
            for gemm in ("w13", "w2"):
                configs.setdefault(c["shape_keys"][gemm], {})[c["T"]] = c["best"][gemm]["config"]
    configs = {key: {str(t): per_t[t] for t in sorted(per_t)} for key, per_t in configs.items()}
    return {"device": info["device"], "dtype": dtype, "triton": info["triton"], "torch": info["torch"],
            "made_by": "gpu/moe_tune.py", "configs": configs,
            "cells": [{k: v for k, v in c.items() if k != "shape_keys"} for c in cells]}


def table_lines(cells: list[dict]) -> list[str]:
    out = [f"{'model':9} {'T':>5} {'current us':>10} {'best us':>9} {'speedup':>7} {'of bound':>8} "
           f"{'GB/s':>6} {'layer cur/tuned us':>19}  BLOCK_M  w13 | w2 (N K warps stages split)"]
    for c in cells:
        b = c.get("best")
        if not b:
            out.append(f"{c['model']:9} {c['T']:>5}  none correct")
            continue
        cur = f"{c['current_us']:10.1f}" if c.get("current_us") else f"{'-':>10}"
        sp = f"{c['speedup']:6.2f}x" if c.get("speedup") else f"{'-':>7}"
        lay = (f"{c['layer_current_us']:8.1f} / {c['layer_tuned_us']:8.1f}" if c.get("layer_tuned_us")
               else f"{'-':>19}")
        cfg = " | ".join(f"{g['BLOCK_N']} {g['BLOCK_K']} {g['num_warps']} {g['num_stages']} {g.get('SPLIT_K', 1)}"
                         for g in (b["w13"]["config"], b["w2"]["config"]))
        out.append(f"{c['model']:9} {c['T']:>5} {cur} {c['best_us']:9.1f} {sp} {100 * c['of_bound']:7.0f}% "
                   f"{c['GBps']:6.0f} {lay}  {b['w13']['config']['BLOCK_M']:>7}  {cfg}")
    return out


# --------------------------------------------------------------------------- the device part

def run(a: argparse.Namespace) -> int:
    found = sweep_device(a.interpret)
    if found is None:
        return 2
    torch, dev, half = found
    import triton

    from zerod.engine.kernels import moe
    from zerod.engine.model import ops

    models = {n: (INTERPRET_MODELS if a.interpret else MODELS)[n] for n in a.models}
    grid = INTERPRET_GRID if a.interpret else GRID
    cands = candidates(grid, prune=not a.interpret)
    ts = token_counts(a)
    tol = TOL["bf16"]
    info = {**machine(torch, dev, a.interpret), "hbm_Bps": HBM, "peak_flops": PEAK["bf16"], "tol": tol, "models": models, "ts": ts,
            "candidates": len(cands), "splits": SPLITS, "dtype": str(half).removeprefix("torch."),
            "timing": "interpreter wall-clock, one call" if a.interpret else
                      f"CUDA graph over cold weight copies, median of {REPS} replays of ~{TARGET_MS} ms, per call"}
    print(json.dumps(info), flush=True)

    cells: list[dict] = []
    result = SweepResult(a.out, info, a.budget_s, cells=cells)
    rows = result.rows
    g = torch.Generator(device=dev).manual_seed(SEED)

    def save() -> None:
        result.save()
        Path(a.table_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.table_out).write_text(json.dumps(table_doc(info, cells, info["dtype"]), indent=1))

    def timed(fns: list) -> float:
        if a.interpret:
            s = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - s) * 1e6
        return graph_us(torch, fns)

    def compile_ahead(jobs: list) -> None:
        """Run jobs (thunks calling _gemm with warmup=True) under Triton's AsyncCompileMode,
        the compiles on a thread per core (those done already are cache hits); a config
        that fails to compile fails again, and is recorded, when measured."""
        mode = getattr(triton, "AsyncCompileMode", None)
        if a.interpret or mode is None:   # an older Triton: each compiles at its first call
            return
        from concurrent.futures import ThreadPoolExecutor

        s = time.perf_counter()
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as ex, mode(ex, ignore_errors=True):
            for job in jobs:
                try:
                    job()
                except Exception:   # noqa: BLE001  (recorded when measured)
                    pass
        print(f"{len(jobs)} kernels compiled or cached in {time.perf_counter() - s:.1f} s", flush=True)

    fatal = None
    for name, m in models.items():
        e, k, h, i = m["E"], m["top_k"], m["H"], m["I"]
        w13 = (torch.randn(e, 2 * i, h, generator=g, device=dev) / math.sqrt(h)).to(half)
        w2 = (torch.randn(e, h, i, generator=g, device=dev) / math.sqrt(i)).to(half)
        copies = {"w13": [w13], "w2": [w2]}
        keys = {"w13": moe.shape_key(*w13.shape), "w2": moe.shape_key(*w2.shape)}
        for t in ts:
            if fatal or result.over_budget():
                break
            cell, fatal = measure_cell(torch, moe, ops, a, name, m, t, copies, keys, cands, g, half, tol,
                                       timed, compile_ahead, rows)
            cells.append(cell)
            save()
            b = cell.get("best")
            print(f"{name} T={t}: " + (f"current {cell.get('current_us') or float('nan'):.1f} us, best "
                                       f"{cell['best_us']:.1f} us ({100 * cell['of_bound']:.0f} % of bound), "
                                       f"layer {cell.get('layer_current_us') or float('nan'):.1f} -> "
                                       f"{cell.get('layer_tuned_us') or float('nan'):.1f} us" if b
                                       else "none correct") + f", {result.elapsed():.0f} s", flush=True)
        del w13, w2, copies
        if result.doc["stopped_early"] or fatal:
            break
    result.finish(fatal)
    save()
    # the table as the engine will read it
    table = moe.load_table(Path(a.table_out))
    print("\n" + ("times: the interpreter's wall-clock, not a GPU's\n" if a.interpret else "") +
          "\n".join(table_lines(cells)))
    bad = [r for r in rows if not r.get("ok")]
    target = moe.table_path(info["device"]) if not a.interpret else "-"
    print(f"\n{len(rows)} rows, {len(bad)} excluded (wrong or failed); {len(table.shapes)} GEMM shapes in "
          f"{a.table_out} (install as {target}); {a.out}; {result.elapsed():.0f} s", flush=True)
    return 1 if fatal else 0


def measure_cell(torch, moe, ops, a, name, m, t, copies, keys, cands, g, half, tol, timed,
                 compile_ahead, rows) -> tuple[dict, str | None]:
    """Both GEMMs of one (model, T) at each candidate, the pick, the layer with it."""
    e, k, h, i = m["E"], m["top_k"], m["H"], m["I"]
    w13, w2 = copies["w13"][0], copies["w2"][0]
    dev = w13.device
    ids = torch.rand(t, e, generator=g, device=dev).argsort(dim=1)[:, :k].contiguous()   # k distinct experts
    wts = torch.rand(t, k, generator=g, device=dev) + 0.1
    wts = wts / wts.sum(dim=1, keepdim=True)
    x = torch.randn(t, h, generator=g, device=dev).to(half)
    a2 = torch.randn(t * k, i, generator=g, device=dev).to(half)
    flat = ids.reshape(-1)
    touched = flat.unique().tolist()
    # float32 references: each pair's w13 row, each token's weighted w2 sum
    ref13 = torch.zeros(t * k, 2 * i, device=dev)
    ref2 = torch.zeros(t * k, h, device=dev)
    for ex in touched:
        p = (flat == ex).nonzero().squeeze(1)
        ref13[p] = x[p // k].float() @ w13[ex].float().T
        ref2[p] = (a2[p].float() @ w2[ex].float().T) * wts.reshape(-1)[p, None]
    ref2 = ref2.view(t, k, h).sum(dim=1)
    avg = t * k / e
    cur_bm = moe._config(avg, 2 * i)["BLOCK_M"]
    current = {"w13": moe._config(avg, 2 * i), "w2": dict(moe._config(avg, h), BLOCK_M=cur_bm)}
    bms = sorted(set(block_ms(avg, (INTERPRET_GRID if a.interpret else GRID)["BLOCK_M"])) | {cur_bm})
    aligned = {bm: moe.align(ids, e, bm) for bm in bms}
    for gemm, w in (("w13", w13), ("w2", w2)):   # enough copies that a call reads cold weights
        want = 1 if a.interpret else max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / (len(touched) * w[0].nbytes))))
        copies[gemm] += [w.clone() for _ in range(want - len(copies[gemm]))]
    wflat = wts.reshape(-1).float().contiguous()

    def call(gemm: str, cfg: dict, w, warmup: bool = False):
        s, x_e, tot = aligned[cfg["BLOCK_M"]]
        if gemm == "w13":
            return moe._gemm(x, w, None, s, x_e, tot, k, cfg, t * k, warmup=warmup)
        out = moe._gemm(a2, w, wflat, s, x_e, tot, 1, cfg, t * k, warmup=warmup)
        return None if warmup else moe.sum_pairs(out, t, k, half)

    def configs_of(gemm: str) -> list[dict]:
        out = [c for c in cands if c["BLOCK_M"] in bms]
        return out + ([current[gemm]] if current[gemm] not in out else [])

    def ahead(todo: list[tuple[str, dict]]) -> None:
        compile_ahead([lambda gemm=gemm, cfg=cfg: call(gemm, cfg, copies[gemm][0], warmup=True)
                       for gemm, cfg in todo])

    cell_rows: list[dict] = []
    fatal = None

    def run_configs(gemm: str, cfgs: list[dict]) -> None:
        nonlocal fatal
        ref = ref13 if gemm == "w13" else ref2
        common = {"impl": "triton", "model": name, "gemm": gemm, "T": t, "E": e, "N": copies[gemm][0].shape[1],
                  "K": copies[gemm][0].shape[2], "top_k": k, "touched": len(touched),
                  "bytes": gemm_bytes(gemm, m, t, len(touched)), "bound_us": bound_us(gemm, m, t, len(touched))}
        for cfg in cfgs:
            fns = [lambda w=w: call(gemm, cfg, w) for w in copies[gemm]]
            r = measure(torch, dict(common, config=cfg, current=cfg == current[gemm]), fns, ref, None, tol, timed)
            if "us" in r:
                r["GBps"] = r["bytes"] / r["us"] / 1e3
            cell_rows.append(r)
            fatal = r.get("fatal")
            if fatal:
                return

    todo = [(gemm, c) for gemm in ("w13", "w2") for c in configs_of(gemm)]
    ahead(todo)
    for gemm in ("w13", "w2"):
        if not fatal:
            run_configs(gemm, configs_of(gemm))
    if not fatal and t <= DECODE_MAX:   # split-K for w2's few programs: the fastest unsplit configs
        ok = sorted((r for r in cell_rows if r["gemm"] == "w2" and r.get("ok") and "us" in r), key=lambda r: r["us"])
        min_steps = 1 if a.interpret else SPLIT_MIN_STEPS
        splits = [dict(r["config"], SPLIT_K=s) for r in ok[:SPLIT_TOP] for s in SPLITS
                  if split_ok(i, r["config"]["BLOCK_K"], s, min_steps)]
        ahead([("w2", c) for c in splits])
        run_configs("w2", splits)
    rows.extend(cell_rows)

    cell = {"model": name, "T": t, "pairs_per_expert": avg, "touched": len(touched), "block_ms": bms,
            "shape_keys": keys}
    best = pick(cell_rows, bms)
    cur = [next((r for r in cell_rows if r["gemm"] == gm and r["current"]), None) for gm in ("w13", "w2")]
    if best is None:
        return cell, fatal
    bm, b13, b2 = best
    cell["best"] = {gm: {"config": r["config"], "us": r["us"], "of_bound": r["of_bound"], "GBps": r["GBps"]}
                    for gm, r in (("w13", b13), ("w2", b2))}
    cell["best_us"] = b13["us"] + b2["us"]
    cell["bound_us"] = b13["bound_us"] + b2["bound_us"]
    cell["of_bound"] = cell["bound_us"] / cell["best_us"]
    cell["GBps"] = (b13["bytes"] + b2["bytes"]) / cell["best_us"] / 1e3
    if all(r is not None and r.get("ok") and "us" in r for r in cur):
        cell["current_us"] = cur[0]["us"] + cur[1]["us"]
        cell["speedup"] = cell["current_us"] / cell["best_us"]
    if not fatal:
        fatal = measure_layer(torch, moe, ops, cell, x, wts, ids, copies, keys, half, tol, timed)
    return cell, fatal


def measure_layer(torch, moe, ops, cell, x, wts, ids, copies, keys, half, tol, timed) -> str | None:
    """The whole layer (fused_experts) with the current tiles and with this cell's tuned ones
    (through the engine's table parser), each checked against a float32 reference."""
    t = cell["T"]
    k = ids.shape[1]
    doc = {"dtype": str(half).removeprefix("torch."),
           "configs": {keys[gm]: {str(t): cell["best"][gm]["config"]} for gm in ("w13", "w2")}}
    tuned = moe.parse_table(doc, "this cell")
    w13, w2 = copies["w13"][0], copies["w2"][0]
    with ops.kernels_disabled(["silu_and_mul"]):
        ref = torch.zeros(t, x.shape[1], device=x.device)
        for ex in ids.unique().tolist():
            tok, slot = torch.where(ids == ex)
            y = ops.silu_and_mul(x[tok].float() @ w13[ex].float().T) @ w2[ex].float().T
            ref.index_add_(0, tok, y * wts[tok, slot, None])
    n = max(len(copies["w13"]), len(copies["w2"]))
    for label, table in (("current", moe.NO_TABLE), ("tuned", tuned)):
        fns = [lambda j=j: moe.fused_experts(x, copies["w13"][j % len(copies["w13"])],
                                             copies["w2"][j % len(copies["w2"])], wts, ids, ops.silu_and_mul,
                                             table=table) for j in range(n)]
        # 2 x tol: the intermediate and the activation are rounded to 16 bits too
        r = measure(torch, {"impl": label, "bound_us": cell["bound_us"]}, fns, ref, None, 2 * tol, timed)
        cell[f"layer_{label}_rel_err"] = r.get("rel_err")
        if r.get("ok") and "us" in r:
            cell[f"layer_{label}_us"] = r["us"]
        elif "error" in r or not r.get("ok"):
            cell[f"layer_{label}_error"] = r.get("error", f"rel_err {r.get('rel_err')}")
        if r.get("fatal"):
            return r["fatal"]
    return None


def graph_us(torch, fns: list) -> float:
    """Per call: fns (one per weight copy) captured in a CUDA graph, repeated to ~TARGET_MS
    (a one-round graph's replay says how many rounds), the median of REPS replays: shorter
    than the skinny sweep's graphs, as this sweep times ~10^4 of them."""
    for f in fns:
        f()   # compiled outside the capture
    torch.cuda.synchronize()

    def capture(rounds: int):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(rounds):
                for f in fns:
                    f()
        gr.replay()   # the first replay uploads the graph
        return gr

    gr = capture(1)
    rounds = max(1, min(50, int(TARGET_MS / max(replay_ms(torch, gr, 2), 1e-3))))
    if rounds > 1:
        del gr
        gr = capture(rounds)
    us = replay_ms(torch, gr, REPS) * 1e3 / (rounds * len(fns))
    del gr
    return us


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
