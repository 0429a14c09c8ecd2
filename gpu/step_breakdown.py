"""A decode step's kernels against their own bounds, from a gpu/decode_profile.py JSON (the
Llama-3-8B shape): per window, the GEMMs, attention and the small kernels, each with its
measured device time per step and its roofline bound, max(bytes / copy bandwidth,
FLOPs / GEMM peak), at the bandwidth and peaks `zerod diag --level full` measured on the
same GPU model (docs/perf.md "Daemon").

    python3 gpu/step_breakdown.py PROFILE.json [--window "200 x"] [--ctx 88]

The GEMMs are judged together (cuBLASLt's kernel names do not say which projection they
serve, and one kernel may serve several): the four projections of every layer at the
window's rows (FP8 weights where quantized) and the bf16 LM head. Attention's bound reads
each sequence's KV once at `--ctx` tokens of context (the wave's mean: 24 prompt + 64 of
its 128 outputs).
"""

from __future__ import annotations

import argparse
import json

HBM = 4.245e12                      # B/s: diag's copy, read + write, on an H200
PEAK = {"bf16": 808.4e12, "fp8": 1491.7e12}   # FLOP/s: diag's checked GEMMs
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 32, 4096, 8, 128
PROJ = {  # parameters per layer, Llama-3-8B
    "gate_up": HIDDEN * 2 * 14336, "down": 14336 * HIDDEN,
    "qkv": HIDDEN * (HIDDEN + 2 * KV_HEADS * HEAD_DIM), "o": HIDDEN * HIDDEN,
}
LM_HEAD = HIDDEN * 128256
ATTENTION_KERNELS = ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")   # engine/kernels
ATTENTION_LIBS = ("fmha", "flash", "cudnn")   # SDPA's backends, named inside their kernels' names


def is_gemm(name: str) -> bool:
    return name.startswith(("nvjet", "_w8a16")) or "gemm" in name.lower() or "cutlass" in name


def is_attention(name: str) -> bool:
    return name.startswith(ATTENTION_KERNELS) or any(a in name for a in ATTENTION_LIBS)


def bound_us(params: float, rows: int, weight_bytes: float, peak: float) -> float:
    return 1e6 * max(params * weight_bytes / HBM, 2 * rows * params / peak)


def breakdown(w: dict, fp8: bool, ctx: int) -> list[tuple[str, float, float | None]]:
    """(what, measured us/step, bound us/step or None) rows of one window."""
    rows_per_step = w["streams"]
    peak = PEAK["fp8" if fp8 else "bf16"]
    wb = 1.0 if fp8 else 2.0
    kernels = w["kernels"]
    gemm = sum(us for n, us, _ in kernels if is_gemm(n) or "splitKreduce" in n)
    n_gemm = sum(1 for n, _, _ in kernels if is_gemm(n))
    layers = sum(bound_us(p * LAYERS, rows_per_step, wb, peak) for p in PROJ.values())
    head = bound_us(LM_HEAD, rows_per_step, 2.0, PEAK["bf16"])   # the LM head stays bf16
    att = sum(us for n, us, _ in kernels if is_attention(n))
    kv = rows_per_step * ctx * 2 * KV_HEADS * HEAD_DIM * 2 * LAYERS   # K and V, bf16, read once
    rest = sum(us for n, us, _ in kernels
               if not (is_gemm(n) or "splitKreduce" in n or is_attention(n)))
    return [(f"GEMMs: 4 projections x {LAYERS} layers + the LM head ({n_gemm} kernels, split-K reduce included)",
             gemm, layers + head),
            (f"attention (KV read once at {ctx} tokens of context)", att, 1e6 * kv / HBM),
            ("norms, RoPE, SiLU, KV writes, quantization, sampling, copies", rest, None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--window", default="200 x", help="windows whose name starts with this")
    ap.add_argument("--ctx", type=int, default=88, help="mean context per sequence, for attention's bound")
    a = ap.parse_args()
    d = json.load(open(a.profile))
    fp8 = d["config"].get("quantization") == "fp8"
    for w in d["windows"]:
        if not w["window"].startswith(a.window):
            continue
        rows = breakdown(w, fp8, a.ctx)
        print(f"\n{'FP8' if fp8 else 'bf16'}, {w['window']}: {w['wall_ms_per_step']:.2f} ms a step wall, "
              f"{w['busy_ms_per_step']:.2f} ms of kernels, {w['tokens'] / w['wall_s']:,.0f} tokens/s in-process")
        print("| kernels | µs a step | bound | of the bound |\n|---|---|---|---|")
        for what, us, b in rows:
            print(f"| {what} | {us:,.0f} | {'-' if b is None else f'{b:,.0f}'} | "
                  f"{'-' if b is None else f'{100 * b / us:.0f} %'} |")
        bounded = [(us, b) for _, us, b in rows if b is not None]
        print(f"| **sum** | {sum(us for _, us, _ in rows):,.0f} | {sum(b for _, b in bounded):,.0f} "
              f"(bounded rows) | {100 * sum(b for _, b in bounded) / sum(us for us, _ in bounded):.0f} % of theirs |")


if __name__ == "__main__":
    main()
