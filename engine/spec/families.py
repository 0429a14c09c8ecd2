"""The model families the engine serves, each declared once: the architecture name in
config.json, what its config and checkpoint need of the engine, and what it refuses and
why. hf_config.py reads a config by its family's declaration, servable.py refuses by it,
the model and loader build by it; nothing else names a family's traits.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a family may refuse (Family.refuses' keys); servable.py raises them.
FP8_WEIGHTS = "fp8_weights"            # FP8 checkpoints and --quantization fp8
TENSOR_PARALLEL = "tensor_parallel"    # --tensor-parallel-size > 1


@dataclass(frozen=True)
class Family:
    name: str                      # ModelConfig.family
    architecture: str              # config.json's architectures[0]
    qkv_bias: bool = False         # q/k/v always carry a bias and o never does (Qwen2); else attention_bias
    qk_norm: bool = False          # RMSNorm over each q and k head before RoPE
    sliding: str = ""              # "": none; "every": every layer slides when sliding_window is set;
                                   # "opt_in": use_sliding_window, then layer_types or max_window_layers;
                                   # "gemma": layer_types or the family's fixed pattern (sliding_pattern)
    sliding_pattern: int = 0       # "gemma" without layer_types: every n-th layer is global
                                   # (the config's sliding_window_pattern when it states one)
    local_rope: bool = False       # sliding layers keep their own RoPE base, unscaled
    gemma_norms: bool = False      # norms stored as w - 1, after attention and MLP too; scaled embeddings;
                                   # "gelu" runs as the tanh approximation; soft-caps; query_pre_attn_scalar
    experts: str = ""              # "": dense; "every": each layer's MLP is experts, the router renormalises;
                                   # "stepped": decoder_sparse_step / mlp_only_layers pick them
    expert_tensors: tuple[str, ...] = ()   # the checkpoint's names: (module, gate, up, down) of
                                           # <layer>.<module>.experts.N.<gate|up|down>.weight
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj already fused
    refuses: tuple[tuple[str, str], ...] = ()   # (FP8_WEIGHTS | TENSOR_PARALLEL, the refusal's words)

    def refusal(self, what: str) -> str | None:
        """Why this family refuses `what`, None when it does not."""
        return dict(self.refuses).get(what)


_EXPERT_REFUSALS = (
    (FP8_WEIGHTS, "FP8 weights for mixtures of experts are not supported (the fused experts kernel "
                  "runs in the model dtype); serve it unquantized (--kv-cache-dtype fp8 works)"),
    (TENSOR_PARALLEL, "--tensor-parallel-size > 1 is not supported for mixtures of experts yet: "
                      "every GPU would hold every expert"),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", sliding="every"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, sliding="opt_in"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="opt_in"),
    # Phi-3 and Phi-4
    Family("phi3", "Phi3ForCausalLM", sliding="every", fused_checkpoint=True,
           refuses=((TENSOR_PARALLEL, "--tensor-parallel-size > 1 is not supported for Phi-3 / Phi-4 yet "
                                      "(their checkpoints store qkv_proj and gate_up_proj fused)"),)),
    Family("gemma2", "Gemma2ForCausalLM", sliding="gemma", sliding_pattern=2, gemma_norms=True),
    # the text-only checkpoints (Gemma 3 1B, text towers saved alone)
    Family("gemma3", "Gemma3ForCausalLM", qk_norm=True, sliding="gemma", sliding_pattern=6,
           local_rope=True, gemma_norms=True),
    Family("mixtral", "MixtralForCausalLM", sliding="every", experts="every",
           expert_tensors=("block_sparse_moe", "w1", "w3", "w2"), refuses=_EXPERT_REFUSALS),
    # Qwen3 attention; experts on the layers decoder_sparse_step picks
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, sliding="opt_in", experts="stepped",
           expert_tensors=("mlp", "gate_proj", "up_proj", "down_proj"), refuses=_EXPERT_REFUSALS),
)

BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
BY_NAME = {f.name: f for f in FAMILIES}
