"""Write a config-only model directory for `zerod serve --load-format dummy`.

    python3 gpu/server_make_model.py DIR [--shape 8b|70b|tiny]

8b: the Llama-3-8B shape of docs/perf.md (32 layers, hidden 4096, 32 heads, 8 KV
heads, intermediate 14336, vocab 128256, rope_theta 500000, max_position_embeddings
32768, as bench/hf_compare.py builds it); 70b: Llama-3-70B (80 layers, hidden 8192, 64 heads,
8 KV heads, intermediate 28672); tiny: a CPU smoke-test shape.
The tokenizer is the demo one (zerod.engine.demo.write_tokenizer): prompts are token ids
anyway, and the detokenizer emits "" for sampled ids beyond its vocabulary.
No weights are written: dummy loading draws them on the device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               max_position_embeddings=32768),
    # Llama-3-70B (tensor parallelism: gpu/tp.sh)
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 max_position_embeddings=4096),
}


def write_dummy(d: Path, cfg: dict) -> None:
    """The demo tokenizer and config.json in d: cfg (bfloat16 unless it says) with the
    tokenizer's bos / eos ids."""
    from zerod.engine.demo import write_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer(d)
    tok = json.loads((d / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    cfg = {"torch_dtype": "bfloat16", **cfg,
           "bos_token_id": added.get("<s>", 0), "eos_token_id": added.get("</s>", 1)}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    a = ap.parse_args()
    write_dummy(Path(a.dir), {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                              "tie_word_embeddings": False, "attention_bias": False, **SHAPES[a.shape]})
    print(f"wrote {a.dir}/config.json ({a.shape}) and the demo tokenizer")


if __name__ == "__main__":
    main()
