"""Helpers of gpu/serving.sh lora.

    python3 gpu/lora_bench.py adapters MODEL_DIR OUT_DIR N RANK
        N PEFT adapters (adapter_config.json + adapter_model.safetensors, random bf16
        weights, every projection) for the model in MODEL_DIR, as OUT_DIR/a0 ... a{N-1}
        (written with safetensors alone: the device has no peft).
    python3 gpu/lora_bench.py load URL OUT.json --models m1,m2,... --streams S
            --requests R --input-len I --output-len O
        R greedy requests of I random prompt ids, O output tokens each (ignore_eos), S at
        once, request k naming model k mod len(models), streamed; writes output tokens/s
        over the run, the mean per-request decode rate ((O-1) / time from first to last
        token) and the failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model_dir: str, out: str, n: int, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(0)
    for a in range(n):
        d = Path(out) / f"a{a}"
        d.mkdir(parents=True, exist_ok=True)
        t = {}
        for layer in range(L):
            for m in MODULES:
                n_in, n_out = shapes[m]
                kind = "self_attn" if m in MODULES[:4] else "mlp"
                p = f"base_model.model.model.layers.{layer}.{kind}.{m}"
                t[p + ".lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * 0.01).bfloat16()
                t[p + ".lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).bfloat16()
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
            "bias": "none", "use_dora": False, "use_rslora": False, "lora_dropout": 0.0}))
    print(f"wrote {n} rank-{rank} adapters under {out}")


async def run_load(a) -> None:
    import aiohttp

    models = a.models.split(",")
    rng = random.Random(0)
    sem = asyncio.Semaphore(a.streams)
    rates, failed, tokens = [], [], [0]

    async def one(session, k):
        body = {"model": models[k % len(models)], "prompt": [rng.randrange(5, 1000) for _ in range(a.input_len)],
                "max_tokens": a.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
        async with sem:
            times = []
            try:
                async with session.post(a.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        failed.append(f"{body['model']}: HTTP {r.status} {await r.text()}")
                        return
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            times.append(time.perf_counter())
            except aiohttp.ClientError as exc:
                failed.append(f"{body['model']}: {exc}")
                return
            tokens[0] += a.output_len
            if len(times) > 2:
                rates.append((a.output_len - 1) / (times[-1] - times[0]))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(one(s, k) for k in range(min(a.streams, a.requests))))   # warm-up wave
        tokens[0], rates[:] = 0, []
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, k) for k in range(a.requests)))
        wall = time.perf_counter() - t0
    res = {"models": models, "streams": a.streams, "requests": a.requests,
           "output_throughput": tokens[0] / wall, "decode_tok_s_per_request": sum(rates) / max(len(rates), 1),
           "failed": len(failed), "errors": failed[:5], "wall_s": wall}
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("adapters")
    w.add_argument("model_dir")
    w.add_argument("out")
    w.add_argument("n", type=int)
    w.add_argument("rank", type=int)
    ld = sub.add_parser("load")
    ld.add_argument("url")
    ld.add_argument("out")
    for f, d in (("--streams", 200), ("--requests", 400), ("--input-len", 24), ("--output-len", 128)):
        ld.add_argument(f, type=int, default=d)
    ld.add_argument("--models", required=True)
    a = ap.parse_args()
    if a.cmd == "adapters":
        write_adapters(a.model_dir, a.out, a.n, a.rank)
    else:
        asyncio.run(run_load(a))


if __name__ == "__main__":
    sys.exit(main())
