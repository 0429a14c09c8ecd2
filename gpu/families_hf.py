"""transformers' batch-1 greedy decode on a config-only model directory (random weights),
the HF side of gpu/serving.sh families:

    python3 gpu/families_hf.py DIR --out hf.json [--device cuda|cpu] [--tokens 128]

Builds the model from DIR/config.json in bfloat16 on the GPU (float32 on the CPU), decodes
--tokens tokens after a 16-token prompt and writes {"decode_tokens_per_s", "build_s"}; on
CUDA out-of-memory it writes {"skipped": why} (Mixtral-8x7B's 93 GB only barely fit).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    import transformers

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    res: dict[str, object] = {"transformers": transformers.__version__}
    t0 = time.perf_counter()
    try:
        cfg = transformers.AutoConfig.from_pretrained(a.dir)
        torch.manual_seed(0)
        with dev:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        res["build_s"] = time.perf_counter() - t0
        ids = torch.randint(5, 1000, (1, 16), device=dev)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        res["decode_tokens_per_s"] = a.tokens / (time.perf_counter() - t)
    except torch.OutOfMemoryError as exc:
        res["skipped"] = f"CUDA out of memory building or running the model: {str(exc).splitlines()[0]}"
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
