"""Write a config-only model directory of a family's shape for `zerod serve --load-format dummy`
(and gpu/families_hf.py, which builds transformers' model from the same config.json).

    python3 gpu/families_model.py DIR --shape qwen3-8b|gemma2-9b|mixtral-8x7b|tiny-qwen3|tiny-gemma2|tiny-mixtral

The shapes are the published configs' (sizes, heads, RoPE base, Gemma 2's soft-caps and
sliding window, Mixtral's 8 experts top-2); tiny-*: the same families at CPU smoke size.
The tokenizer is the demo one, as gpu/server_make_model.py writes it; no weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from server_make_model import write_dummy  # noqa: E402 - gpu/ is this script's folder

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6,
             hidden_act="silu", attention_bias=False, tie_word_embeddings=False)
GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", rope_theta=10000.0, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              tie_word_embeddings=True, attention_bias=False)
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", rope_theta=1000000.0, rms_norm_eps=1e-5,
               hidden_act="silu", tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=None)
SHAPES = {
    "qwen3-8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    "gemma2-9b": dict(GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                      sliding_window=4096, query_pre_attn_scalar=256),
    "mixtral-8x7b": dict(MIXTRAL, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=32768),
    "tiny-qwen3": dict(QWEN3, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096),
    "tiny-gemma2": dict(GEMMA2, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096,
                        sliding_window=64, query_pre_attn_scalar=32),
    "tiny-mixtral": dict(MIXTRAL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None,
                    help="fewer decoder layers than the shape has (each layer as published): "
                         "Mixtral's 93 GB of bf16 weights at 16 of 32 layers fit an 80 GB GPU")
    a = ap.parse_args()
    cfg = dict(SHAPES[a.shape], pad_token_id=0)
    if a.layers is not None:
        if not 1 <= a.layers <= cfg["num_hidden_layers"]:
            ap.error(f"--layers must be 1..{cfg['num_hidden_layers']}")
        cfg["num_hidden_layers"] = a.layers
    write_dummy(Path(a.dir), cfg)
    print(f"wrote {a.dir}/config.json ({a.shape}, {cfg['num_hidden_layers']} layers) and the demo tokenizer")


if __name__ == "__main__":
    main()
