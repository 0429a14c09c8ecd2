"""Sizing: the dtype the engine serves in, the bytes one token of KV cache takes, how many
KV pages the pool gets and the max_model_len those pages allow.

Everything above `plan_kv` is arithmetic on names and numbers and imports no torch, so
`zerod doctor` sizes a model with the very formula the engine allocates with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import EngineConfig, EngineError

if TYPE_CHECKING:  # the engine's types; only plan_kv needs them, and only at run time on CUDA
    from .hf_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP8_KV = "fp8_e4m3"                # the KV pages' dtype under --kv-cache-dtype fp8
KV_DTYPE_BYTES = {**DTYPE_BYTES, FP8_KV: 1}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}

CPU_KV_BUDGET = 256 << 20          # KV bytes on the CPU when neither kv_pages nor a budget is given
GRAPH_HEADROOM = 1 << 30           # CUDA graphs, cuBLAS workspaces, fragmentation


def canonical_dtype(name: str) -> str:
    """bfloat16 | float16 | float32 for any name the engine accepts (torch.bfloat16, bf16, ...)."""
    n = str(name).removeprefix("torch.")
    n = _ALIASES.get(n, n)
    if n not in DTYPE_BYTES:
        raise EngineError(f"unsupported dtype {name!r}; use bfloat16, float16 or float32")
    return n


def serving_dtype(requested: str, checkpoint_dtype: str | None, device_type: str) -> str:
    """The dtype policy. `auto`: float32 on the CPU (no fast half-precision matmuls there);
    on CUDA the checkpoint's dtype, bfloat16 when that is float32 or not given."""
    if requested != "auto":
        return canonical_dtype(requested)
    if device_type == "cpu":
        return "float32"
    dtype = canonical_dtype(checkpoint_dtype or "bfloat16")
    return "bfloat16" if dtype == "float32" else dtype


def kv_cache_dtype(requested: str, dtype: str) -> str:
    """The KV pages' dtype: the serving dtype for `auto`, fp8_e4m3 for fp8 / fp8_e4m3."""
    if requested == "auto":
        return canonical_dtype(dtype)
    if requested in ("fp8", FP8_KV):
        return FP8_KV
    raise EngineError(f"kv_cache_dtype {requested!r} is not auto, fp8 or fp8_e4m3")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for one token; dtype: the pages' (a serving dtype or fp8_e4m3)."""
    return 2 * num_layers * num_kv_heads * head_dim * KV_DTYPE_BYTES[dtype if dtype == FP8_KV else canonical_dtype(dtype)]


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int          # 0: no mixture of experts
    expert_size: int          # one expert's intermediate size
    sparse: list[bool]        # per layer: experts (True) or the dense MLP


def expert_layout(raw: dict) -> ExpertLayout:
    """Which layers of an HF config hold experts, and how many of what size. Mixtral: every
    layer, of intermediate_size. Qwen3-MoE: experts of moe_intermediate_size on every
    decoder_sparse_step-th layer not in mlp_only_layers. Raises ValueError/TypeError on junk."""
    layers = int(raw["num_hidden_layers"])
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    size = int(raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step} must be positive")
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return ExpertLayout(experts, size, sparse)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank holds: its share, or one replicated head when
    the ranks outnumber them."""
    return max(num_kv_heads // tp, 1)


def rank_config(mc: ModelConfig, n: int) -> ModelConfig:
    """The model as one rank holds it: its attention heads, its KV heads (split, or one
    replicated head when N exceeds them) and its slice of the MLP. Vocabulary and hidden
    size stay whole (the vocabulary split is the embedding's and LM head's own)."""
    if n == 1:
        return mc
    return replace(mc, num_heads=mc.num_heads // n, num_kv_heads=kv_heads_per_rank(mc.num_kv_heads, n),
                   intermediate_size=mc.intermediate_size // n)


def vocab_rows(vocab: int, n: int) -> int:
    """Rows of the embedding / LM head each rank holds (the last rank's tail is padding)."""
    return -(-vocab // n)


def page_bytes(mc: ModelConfig, page_size: int, dtype: str, tp: int = 1) -> int:
    """One KV page on one GPU (a rank holds only its KV heads)."""
    return page_size * kv_bytes_per_token(mc.num_layers, kv_heads_per_rank(mc.num_kv_heads, tp),
                                          mc.head_dim, dtype)


def activation_headroom(cfg: EngineConfig, mc: ModelConfig) -> int:
    """CUDA bytes kept free for activations: a prefill of the largest token budget, plus
    the logits and sampling of a full decode batch, plus graphs and workspaces."""
    t = cfg.prefill_token_cap
    # a mixture of experts holds k expert rows per token (and their outputs)
    inter = max(mc.intermediate_size, mc.experts_per_token * (mc.moe_intermediate_size + mc.hidden_size))
    act = t * (6 * mc.hidden_size + 3 * inter + 2 * (mc.q_size + 2 * mc.kv_size)) * 4
    act += cfg.max_num_seqs * mc.vocab_size * 4 * 8
    act += t * t * 2 if t <= 8192 else 0      # a block-diagonal prefill mask
    return act + GRAPH_HEADROOM


def cuda_kv_pages(free: int, total: int, utilization: float, headroom: int, page_nbytes: int) -> int:
    """Pages that fit in utilization x total, less what is already used (weights) and the headroom."""
    budget = utilization * total - (total - free) - headroom
    pages = int(budget // page_nbytes)
    if pages < 2:
        raise EngineError(
            f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
            f"after loading the weights, gpu_memory_utilization {utilization} leaves "
            f"{budget / 2**30:.2f} GiB; raise it or use a smaller model")
    return pages


def wanted_context(cfg: EngineConfig, mc: ModelConfig) -> int:
    """max_model_len before the pool is sized: the flag, else the model's (sliding-window
    layers attend within their window at any length)."""
    return cfg.max_model_len or mc.max_position_embeddings


def fit_context(want: int, explicit: bool, num_pages: int, page_size: int) -> int:
    """max_model_len within what the pool holds (one page is scratch). An explicit
    max_model_len that does not fit is an error; a derived one is capped."""
    cap = (num_pages - 1) * page_size
    if want <= cap:
        return want
    if explicit:
        raise EngineError(f"max_model_len {want} needs {-(-want // page_size)} KV pages, the pool has "
                          f"{num_pages - 1}; lower max_model_len or raise the KV budget")
    return cap


@dataclass(frozen=True)
class KVPlan:
    num_pages: int        # the pool's pages, scratch page 0 included
    max_model_len: int
    page_bytes: int


def plan_kv(cfg: EngineConfig, mc: ModelConfig, dtype: str, device_type: str,
            cuda_mem: tuple[int, int] | None = None) -> KVPlan:
    """The pool's size and the context it allows. cuda_mem: (free, total) bytes on the
    device after the weights are loaded (CUDA only; with tensor parallelism, the least of
    the ranks' GPUs). dtype: the serving dtype; the pages' own follows cfg.kv_cache_dtype."""
    pb = page_bytes(mc, cfg.block_size, kv_cache_dtype(cfg.kv_cache_dtype, dtype), cfg.tensor_parallel_size)
    want = wanted_context(cfg, mc)
    if cfg.kv_pages is not None:
        pages = cfg.kv_pages
    elif device_type == "cuda":
        if cuda_mem is None:
            raise ValueError("CUDA sizing needs the device's free and total memory")
        pages = cuda_kv_pages(*cuda_mem, cfg.gpu_memory_utilization, activation_headroom(cfg, mc), pb)
    else:
        per_seq = -(-want // cfg.block_size)
        pages = min((cfg.kv_cache_memory_bytes or CPU_KV_BUDGET) // pb, cfg.max_num_seqs * per_seq + 1)
        if pages < 2:
            raise EngineError(f"no room for the KV cache: one page of {cfg.block_size} tokens takes "
                              f"{pb / 2**20:.1f} MiB; raise the KV budget")
    return KVPlan(pages, fit_context(want, bool(cfg.max_model_len), pages, cfg.block_size), pb)
