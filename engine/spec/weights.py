"""The bytes a model's weights take on one GPU, from its config alone: every tensor the
model (model/decoder.py) allocates for one rank, in the serving dtype, FP8 projections
at a byte an element with their float32 scales. The KV pool is sized from what the
weights leave (sizing.plan_kv), so doctor sizes the pool from this figure, and the tests
hold it equal to what the engine allocates.
"""

from __future__ import annotations

from .hf_config import ModelConfig
from .quant import QuantConfig, quantizes
from .sizing import DTYPE_BYTES, canonical_dtype, rank_config, vocab_rows

FP8_BYTES = 1
SCALE_BYTES = 4          # weight_scale and input_scale are float32


def weight_bytes(mc: ModelConfig, dtype: str, quant: QuantConfig | None = None, tp: int = 1) -> int:
    """One rank's weights (of tp): embedding, norms, projections, experts, LM head. quant:
    what spec.quant.resolve serves (None: unquantized); projections split over ranks are
    unquantized, as parallel.check_tp requires."""
    db = DTYPE_BYTES[canonical_dtype(dtype)]
    r = rank_config(mc, tp)
    h = mc.hidden_size
    rows = vocab_rows(mc.vocab_size, tp)
    split = tp > 1

    def linear(parts: list[tuple[str, int]], inp: int, bias: bool, q: QuantConfig | None = quant) -> int:
        out = sum(size for _, size in parts)
        if not quantizes(q, parts, inp):
            return out * inp * db + (out * db if bias else 0)
        if q.weights == "block":
            bn, bk = q.block
            scales = -(-out // bn) * -(-inp // bk)
        else:
            scales = out
        static = SCALE_BYTES if q.activations == "static" else 0
        return out * inp * FP8_BYTES + (out * db if bias else 0) + scales * SCALE_BYTES + static

    total = rows * h * db + h * db                      # embedding, final norm
    if not mc.tie_word_embeddings:                      # a tied head is the embedding
        total += rows * h * db if split else linear([("lm_head", mc.vocab_size)], h, False)
    q, kv, i = r.q_size, r.kv_size, r.intermediate_size
    fused = mc.spec.fused_checkpoint
    for n in range(mc.num_layers):
        p = f"model.layers.{n}."
        total += (4 if mc.gemma_norms else 2) * h * db
        total += 2 * mc.head_dim * db if mc.qk_norm else 0
        total += linear([(p + "self_attn.qkv_proj", q + 2 * kv)] if fused else
                        [(p + "self_attn.q_proj", q), (p + "self_attn.k_proj", kv), (p + "self_attn.v_proj", kv)],
                        h, mc.qkv_bias)
        total += linear([(p + "self_attn.o_proj", h)], q, mc.o_bias, None if split else quant)
        if mc.moe_layers and mc.moe_layers[n]:
            e, ei = mc.num_experts, mc.moe_intermediate_size
            total += (e * h + e * 2 * ei * h + e * h * ei) * db     # router, w13, w2
            continue
        total += linear([(p + "mlp.gate_up_proj", 2 * i)] if fused else
                        [(p + "mlp.gate_proj", i), (p + "mlp.up_proj", i)], h, mc.mlp_bias)
        total += linear([(p + "mlp.down_proj", h)], i, mc.mlp_bias, None if split else quant)
    return total
