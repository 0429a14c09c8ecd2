"""What the engine refuses of a model under a configuration, before anything is loaded:
the family's declared refusals (families.py) and the shapes tensor parallelism needs.
`zerod serve` and doctor's engine.config both ask here, so they refuse alike."""

from __future__ import annotations

from ..config import EngineError
from .families import FP8_WEIGHTS, TENSOR_PARALLEL
from .hf_config import ModelConfig
from .quant import QuantConfig


def refuse_unservable(mc: ModelConfig, quant: QuantConfig | None, tp: int = 1, lora: bool = False) -> None:
    """EngineError naming the reason when this model cannot be served with these FP8
    weights (quant: what quant.resolve picked), this many ranks, or LoRA."""
    why = mc.spec.refusal(FP8_WEIGHTS)
    if quant is not None and why:
        raise EngineError(f"{mc.architecture}: {why}")
    refuse_split(mc, tp, quantized=quant is not None, lora=lora)


def refuse_split(mc: ModelConfig, n: int, quantized: bool = False, lora: bool = False) -> None:
    """Refuse, naming the reason, a degree of tensor parallelism this model cannot be
    split over (what the host can run is tp/parallel.check_tp's)."""
    if n == 1:
        return
    if lora:
        raise EngineError("--tensor-parallel-size > 1 is not supported with --enable-lora yet "
                          "(the adapters' slabs are not split over the ranks)")
    if quantized:
        raise EngineError("--tensor-parallel-size > 1 is not supported with FP8 weights yet "
                          "(serve the bfloat16 checkpoint split, or FP8 on one GPU)")
    why = mc.spec.refusal(TENSOR_PARALLEL)
    if why:
        raise EngineError(f"{mc.architecture}: {why}")
    if mc.num_heads % n:
        raise EngineError(f"--tensor-parallel-size {n} must divide num_attention_heads ({mc.num_heads})")
    if mc.num_kv_heads % n and n % mc.num_kv_heads:
        raise EngineError(f"--tensor-parallel-size {n} and num_key_value_heads ({mc.num_kv_heads}) "
                          f"must divide one another (KV heads are split, or replicated when fewer)")
    if mc.intermediate_size % n:
        raise EngineError(f"--tensor-parallel-size {n} must divide intermediate_size "
                          f"({mc.intermediate_size})")


def refuse_gpu_count(n: int, visible: int) -> None:
    """Tensor parallelism takes one GPU a rank."""
    if n > visible:
        raise EngineError(f"--tensor-parallel-size {n} needs {n} GPUs; this process sees {visible}")
