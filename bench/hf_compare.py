"""The Hugging Face transformers side of every side-by-side figure.

Runs HF transformers on the same GPU and the same Llama-3-8B shape (random bf16
weights) as `zerod bench` drives the engine, so each engine figure can be quoted as
a ratio measured in the same device call. Scenarios match zerod bench's names:

    python3 -m zerod.bench.hf_compare --out hf.json [--scenarios hello-ttft,decode-b1,prefill-16k,streams-200]

Only torch and transformers are needed (both are on the GPU image).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCENARIOS = ("hello-ttft", "decode-b1", "prefill-1k", "prefill-16k", "streams-200")


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=32768, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
    return model.eval()


def wall(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")

    model = build_model()
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    gen = lambda ids, n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **greedy)  # noqa: E731
    res: dict[str, object] = {"transformers": __import__("transformers").__version__,
                              "torch": torch.__version__}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    with torch.no_grad():
        if "hello-ttft" in wanted:
            ids = torch.tensor([[1, 15339]], device="cuda")  # "Hello": BOS + one token
            for _ in range(3):
                gen(ids, 1)
            ms = [wall(lambda: gen(ids, 1)) * 1e3 for _ in range(30)]
            res["hello-ttft"] = {"p50_ms": pct(ms, 50), "p95_ms": pct(ms, 95), "p99_ms": pct(ms, 99)}
        if "decode-b1" in wanted:
            ids = torch.tensor([[1, 15339]], device="cuda")
            gen(ids, 16)
            res["decode-b1"] = {"tokens_per_s": 256 / wall(lambda: gen(ids, 256))}
        for name, n in (("prefill-1k", 1024), ("prefill-16k", 16384)):
            if name in wanted:
                p = torch.randint(100, 120000, (1, n), device="cuda")
                gen(p, 1)
                ms = [wall(lambda: gen(p, 1)) * 1e3 for _ in range(5)]
                res[name] = {"median_ms": statistics.median(ms), "max_ms": max(ms)}
            save()
        if "streams-200" in wanted:
            from transformers import GenerationConfig

            model.set_attn_implementation("paged|sdpa")
            reqs = [torch.randint(100, 120000, (24,)).tolist() for _ in range(200)]
            gc = GenerationConfig(max_new_tokens=128, min_new_tokens=128, do_sample=False,
                                  eos_token_id=-1, pad_token_id=0)
            model.generate_batch(inputs=reqs[:4], generation_config=gc, progress_bar=False)
            t = time.perf_counter()
            outs = model.generate_batch(inputs=reqs, generation_config=gc, progress_bar=False)
            dt = time.perf_counter() - t
            ntok = sum(len(o.generated_tokens) for o in outs.values())
            res["streams-200"] = {"output_tokens_per_s": ntok / dt, "tokens": ntok,
                                  "mode": "continuous batching, paged|sdpa"}
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
