"""A decode step's kernels against their own bounds, from a gpu/decode_profile.py JSON: per
window, the GEMMs, attention and the small kernels (and, for a mixture of experts, the
fused expert GEMMs and the routing kernels), each with its measured device time per step
and its roofline bound, max(bytes / copy bandwidth, FLOPs / GEMM peak), at the bandwidth
and peaks `zerod diag --level full` measured on the same GPU model (docs/perf.md "Daemon").

    python3 gpu/step_breakdown.py PROFILE.json [--window "200 x"] [--ctx 88] [--model-config PATH]

The model's shape comes from a Hugging Face config.json: --model-config (the file or its
directory), else the one the profile recorded, else the profiled model directory's (the
profile's config["model"]), else the Llama-3-8B shape built in. Dense GEMMs are judged together (cuBLASLt's kernel names do not
say which projection they serve, and one kernel may serve several): the four projections
of every layer at the window's rows (FP8 weights where quantized) and the bf16 LM head.
A mixture of experts splits them: the fused expert GEMMs against the weights of the
experts the step's rows are expected to touch; attention's projections, the router and
the LM head together. Attention's bound reads each sequence's KV once at `--ctx` tokens
of context (the wave's mean: 24 prompt + 64 of its 128 outputs).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

HBM = 4.245e12                      # B/s: diag's copy, read + write, on an H200
PEAK = {"bf16": 808.4e12, "fp8": 1491.7e12}   # FLOP/s: diag's checked GEMMs
ATTENTION_KERNELS = ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")   # engine/kernels
ATTENTION_LIBS = ("fmha", "flash", "cudnn")   # SDPA's backends, named inside their kernels' names
MOE_GEMM = "_moe_gemm"                                              # engine/kernels/moe.py
ROUTING_KERNELS = ("_route_kernel",   # engine/kernels/router.py: the router's top k
                   "_count_kernel", "_offsets_kernel", "_scatter_kernel")   # the experts' alignment


@dataclass(frozen=True)
class Shape:
    """What the bounds need of a Llama-like model; experts = 0 for a dense MLP."""
    name: str
    layers: int
    hidden: int
    intermediate: int          # the dense MLP's, or one expert's
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def attention_proj(self) -> dict[str, int]:
        """Parameters per layer of attention's projections."""
        q = self.heads * self.head_dim
        return {"qkv": self.hidden * (q + 2 * self.kv_heads * self.head_dim), "o": q * self.hidden}

    @property
    def proj(self) -> dict[str, int]:
        """Parameters per layer of the GEMMs cuBLAS runs: a dense model's four projections;
        a mixture of experts' attention projections and router (its experts are _moe_gemm's)."""
        if self.moe:
            return {**self.attention_proj, "router": self.hidden * self.experts}
        return {"gate_up": self.hidden * 2 * self.intermediate, "down": self.intermediate * self.hidden,
                **self.attention_proj}

    @property
    def lm_head(self) -> int:
        return self.hidden * self.vocab

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down."""
        return 3 * self.hidden * self.intermediate

    def experts_touched(self, rows: int) -> float:
        """Distinct experts a layer's rows x top_k picks are expected to touch, the picks
        taken as uniform and independent."""
        e = self.experts
        return e * (1 - (1 - 1 / e) ** (rows * self.top_k))

    def describe(self) -> str:
        s = f"{self.name}: {self.layers} layers"
        return s + (f", {self.experts} experts top-{self.top_k}" if self.moe else "")


LLAMA3_8B = Shape("Llama-3-8B (built in)", layers=32, hidden=4096, intermediate=14336, heads=32,
                  kv_heads=8, head_dim=128, vocab=128256)


def shape_from_config(raw: dict) -> Shape:
    """The Shape of a Hugging Face config.json's dict. The experts are taken to sit on every
    layer (Mixtral); Qwen's num_experts and moe_intermediate_size are read too."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    moe = experts > 1 and bool(raw.get("num_experts_per_tok"))
    kind = str(raw.get("model_type") or ("mixtral" if moe else "llama"))
    return Shape(name=f"{kind[:1].upper()}{kind[1:]}-like",
                 layers=int(raw["num_hidden_layers"]), hidden=hidden,
                 intermediate=int(moe and raw.get("moe_intermediate_size") or raw["intermediate_size"]),
                 heads=heads, kv_heads=int(raw.get("num_key_value_heads") or heads),
                 head_dim=int(raw.get("head_dim") or hidden // heads), vocab=int(raw["vocab_size"]),
                 experts=experts if moe else 0, top_k=int(raw["num_experts_per_tok"]) if moe else 0)


def load_shape(model_config: str | None, profiled_model: str | None,
               recorded: dict | None = None) -> tuple[Shape, str]:
    """(shape, where it came from): --model-config, else the config.json the profile
    recorded, else the profiled model directory's, else the built-in Llama-3-8B (a
    profile taken on another machine names a directory absent here)."""
    if model_config:
        p = Path(model_config)
        p = p / "config.json" if p.is_dir() else p
        return shape_from_config(json.loads(p.read_text())), str(p)
    if recorded:
        return shape_from_config(recorded), "the profile's config.json"
    if profiled_model and (p := Path(profiled_model) / "config.json").is_file():
        return shape_from_config(json.loads(p.read_text())), str(p)
    return LLAMA3_8B, f"no config.json at {profiled_model}" if profiled_model else "no model named"


def is_gemm(name: str) -> bool:
    return name.startswith(("nvjet", "_w8a16")) or "gemm" in name.lower() or "cutlass" in name


def is_moe_gemm(name: str) -> bool:
    return name.startswith(MOE_GEMM)


def is_routing(name: str) -> bool:
    return name.startswith(ROUTING_KERNELS)


def is_attention(name: str) -> bool:
    return name.startswith(ATTENTION_KERNELS) or any(a in name for a in ATTENTION_LIBS)


def bound_us(params: float, rows: int, weight_bytes: float, peak: float) -> float:
    return 1e6 * max(params * weight_bytes / HBM, 2 * rows * params / peak)


def experts_bound_us(shape: Shape, rows: int, weight_bytes: float, peak: float) -> float:
    """Every touched expert's weights read once per layer; FLOPs of rows x top_k pairs."""
    read = shape.experts_touched(rows) * shape.expert_params * weight_bytes * shape.layers
    flops = 2 * rows * shape.top_k * shape.expert_params * shape.layers
    return 1e6 * max(read / HBM, flops / peak)


def breakdown(w: dict, fp8: bool, ctx: int, shape: Shape = LLAMA3_8B) -> list[tuple[str, float, float | None]]:
    """(what, measured us/step, bound us/step or None) rows of one window."""
    rows_per_step = w["streams"]
    peak = PEAK["fp8" if fp8 else "bf16"]
    wb = 1.0 if fp8 else 2.0
    kernels = w["kernels"]

    def dense_gemm(n: str) -> bool:
        return is_gemm(n) and not (shape.moe and is_moe_gemm(n))

    gemm = sum(us for n, us, _ in kernels if dense_gemm(n) or "splitKreduce" in n)
    n_gemm = sum(1 for n, _, _ in kernels if dense_gemm(n))
    layers = sum(bound_us(p * shape.layers, rows_per_step, wb, peak) for p in shape.proj.values())
    head = bound_us(shape.lm_head, rows_per_step, 2.0, PEAK["bf16"])   # the LM head stays bf16
    att = sum(us for n, us, _ in kernels if is_attention(n))
    kv = rows_per_step * ctx * 2 * shape.kv_heads * shape.head_dim * 2 * shape.layers   # K and V, bf16, read once
    att_row = (f"attention (KV read once at {ctx} tokens of context)", att, 1e6 * kv / HBM)
    if not shape.moe:
        rest = sum(us for n, us, _ in kernels
                   if not (is_gemm(n) or "splitKreduce" in n or is_attention(n)))
        return [(f"GEMMs: 4 projections x {shape.layers} layers + the LM head "
                 f"({n_gemm} kernels, split-K reduce included)", gemm, layers + head),
                att_row,
                ("norms, RoPE, SiLU, KV writes, quantization, sampling, copies", rest, None)]
    experts = sum(us for n, us, _ in kernels if is_moe_gemm(n))
    routing = sum(us for n, us, _ in kernels if is_routing(n))
    rest = sum(us for n, us, _ in kernels
               if not (is_gemm(n) or "splitKreduce" in n or is_attention(n) or is_routing(n)))
    touched = shape.experts_touched(rows_per_step)
    # the experts' own bound: bf16 bytes and peak, --quantization fp8 too, since the fused
    # MoE kernel (engine/kernels/moe.py) reads the bf16 w13 / w2 either way
    return [(f"experts (fused MoE GEMMs): {touched:.1f} of {shape.experts} experts a layer x "
             f"{shape.layers} layers, {rows_per_step} rows x top-{shape.top_k}",
             experts, experts_bound_us(shape, rows_per_step, 2.0, PEAK["bf16"])),
            ("routing (the router's top k; count, offsets, scatter)", routing, None),
            (f"GEMMs: attention projections + router x {shape.layers} layers + the LM head "
             f"({n_gemm} kernels, split-K reduce included)", gemm, layers + head),
            att_row,
            ("norms, RoPE, SiLU, KV writes, quantization, sampling, copies (torch's router top-k "
             "where it runs)", rest, None)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--window", default="200 x", help="windows whose name starts with this")
    ap.add_argument("--ctx", type=int, default=88, help="mean context per sequence, for attention's bound")
    ap.add_argument("--model-config", default=None,
                    help="the model's config.json, or its directory (default: the profiled model's)")
    a = ap.parse_args(argv)
    d = json.loads(Path(a.profile).read_text())
    fp8 = d["config"].get("quantization") == "fp8"
    shape, source = load_shape(a.model_config, d["config"].get("model"), d.get("model_config"))
    for w in d["windows"]:
        if not w["window"].startswith(a.window):
            continue
        rows = breakdown(w, fp8, a.ctx, shape)
        print(f"\n{shape.describe()} ({source}); {'FP8' if fp8 else 'bf16'}, {w['window']}: "
              f"{w['wall_ms_per_step']:.2f} ms a step wall, {w['busy_ms_per_step']:.2f} ms of kernels, "
              f"{w['tokens'] / w['wall_s']:,.0f} tokens/s in-process")
        if shape.moe:   # per layer: readers scale a profile of fewer layers than published
            _, us, b = rows[0]
            print(f"experts: {us / shape.layers:,.1f} µs a layer measured, {b / shape.layers:,.1f} µs "
                  f"a layer bound")
        print("| kernels | µs a step | bound | of the bound |\n|---|---|---|---|")
        for what, us, b in rows:
            print(f"| {what} | {us:,.0f} | {'-' if b is None else f'{b:,.0f}'} | "
                  f"{'-' if b is None or not us else f'{100 * b / us:.0f} %'} |")
        bounded = [(us, b) for _, us, b in rows if b is not None]
        measured = sum(us for us, _ in bounded)
        print(f"| **sum** | {sum(us for _, us, _ in rows):,.0f} | {sum(b for _, b in bounded):,.0f} "
              f"(bounded rows) | {f'{100 * sum(b for _, b in bounded) / measured:.0f} %' if measured else '-'}"
              f" of theirs |")


if __name__ == "__main__":
    main()
