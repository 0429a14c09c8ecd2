"""EngineConfig (the engine's settings; engine/flags.py is their flags' table), how a
token count such as 32k is read, and the engine's errors.

Dataclasses validated when built: a bad value raises EngineError / ValueError at once,
never half-way through loading a model. Pure Python, torch-free: doctor (checks/config.py)
reads `[engine]` with it as `zerod serve` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class EngineError(Exception):
    """The engine cannot start or run with this model / configuration; the message says why."""


class RequestRejected(Exception):
    """A request refused at submit: status 400 (can never fit) or 429 (wait line full)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8",)                       # --quantization (vLLM's names)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # --kv-cache-dtype; fp8 = fp8_e4m3
# A token count as vLLM's command line reads one: 32768, 32k (x1000), 32K (x1024), 1M,
# 1m, 25.6k; `auto` or -1 (where allowed) for "the model's own" (None). The flag table
# (engine/flags.py) and doctor's reading of [engine] (checks/config.py) both use it.
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_MULT = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "K": 1024, "M": 1024 ** 2,
         "G": 1024 ** 3}


def parse_token_count(value: object, auto: bool = False) -> int | None:
    """The count, or None for auto; ValueError saying what is accepted otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if auto and value == -1 else value
    text = str(value).strip()
    if auto and text.lower() in ("auto", "-1"):
        return None
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"{value!r} is not a token count (e.g. 32768, 32k, 32K, 1M"
                         + (", auto" if auto else "") + ")")
    n = float(m.group(1)) * _MULT[m.group(2)]
    if not n.is_integer():
        raise ValueError(f"{value!r} is not a whole number of tokens")
    return int(n)


# Upper bounds of the count flags: buffers are sized by them at start (slots, staging,
# activations), so a typo such as 1e9 is refused here instead of failing an allocation.
MAX_NUM_SEQS = 16384
MAX_COUNT = (1 << 31) - 1   # every other count: what an int32 index holds


def device_type(name: str) -> str:
    """"cuda" or "cpu": the kind of device an EngineConfig.device names, auto resolved to
    cuda where torch sees a GPU (torch is imported for that case alone)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


@dataclass
class EngineConfig:
    model: str = "demo"                    # HF checkpoint dir, or "demo" (built-in tiny model)
    served_model_name: str | None = None
    tokenizer: str | None = None           # dir with tokenizer.json; default: the model dir
    dtype: str = "auto"                    # auto = config.json's torch_dtype (fp32 on CPU)
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    load_format: str = "auto"              # auto | safetensors | dummy (random weights from config.json)
    quantization: str | None = None        # fp8: a bf16 checkpoint quantized at load; None: as the checkpoint
    kv_cache_dtype: str = "auto"           # auto = the model dtype; fp8 (= fp8_e4m3): e4m3 pages with scales
    max_model_len: int | None = None       # default: config's max_position_embeddings (capped by the pool)
    max_num_seqs: int = 256                # most requests running at once
    max_num_batched_tokens: int = 2048     # prompt tokens per step (chunked prefill budget)
    # prompt tokens per step while nothing decodes: no stream to stall, so a long prompt
    # goes in whole (one flash-attention prefill instead of chunks over a cached prefix)
    max_prefill_tokens_idle: int = 16384
    max_waiting: int = 1024                # wait line bound; beyond it submit answers 429
    block_size: int = 16                   # KV page size in tokens
    gpu_memory_utilization: float = 0.90   # CUDA: fraction of the GPU the engine may hold
    kv_pages: int | None = None            # CPU (or CUDA override): number of KV pages
    kv_cache_memory_bytes: int | None = None  # CPU: KV budget in bytes when kv_pages is None
    enforce_eager: bool = False            # CUDA: no CUDA graphs
    cuda_graph_max_bs: int = 256           # largest decode batch captured; larger run eager
    seed: int = 0                          # seeds dummy weights and requests without a seed
    ring_depth: int = 4                    # steps in flight between the step loop and the poller
    enable_prefix_caching: bool = True     # share the KV of full prompt pages between requests
    # while streams decode, prompt chunks are sized from measured step costs (step_cost.py):
    # big enough that waiting prompts get their first token within target_ttft_ms (plus
    # their own prefill time), small enough to keep a step within target_itl_ms, never below
    # min_prefill_chunk nor above max_num_batched_tokens (the cap wins)
    target_itl_ms: float = 50.0
    target_ttft_ms: float = 100.0
    min_prefill_chunk: int = 256
    tensor_parallel_size: int = 1          # ranks (GPUs) the model is split over (parallel.py)
    # multi-LoRA (engine/lora): adapters (name, path, base_model_name or None) served at
    # start; slabs for max_loras adapters of rank <= max_lora_rank on the device at once,
    # host copies of max_cpu_loras (default: max_loras)
    enable_lora: bool = False
    lora_modules: tuple = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def prefill_token_cap(self) -> int:
        """The most prompt tokens one step can take (sizes staging and activations)."""
        return max(self.max_num_batched_tokens, self.max_prefill_tokens_idle)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise EngineError(f"invalid engine config: {msg}")

        if not isinstance(self.model, str) or not self.model:
            bad("model must be a path or 'demo'")
        if self.dtype not in _DTYPES:
            bad(f"dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if self.load_format not in _LOAD_FORMATS:
            bad(f"load_format {self.load_format!r} is not one of {', '.join(_LOAD_FORMATS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            bad(f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            bad(f"device {self.device!r} is not auto, cpu, cuda or cuda:N")
        for name in ("ring_depth", "cuda_graph_max_bs"):
            if int(getattr(self, name)) < 1:
                bad(f"{name} must be >= 1")
        from .flags import config_problems  # the flags' table owns their bounds

        for problem in config_problems(self):
            bad(problem)
        if self.block_size & (self.block_size - 1):
            bad("block_size must be a power of two")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes must be > 0")
        if self.lora_modules and not self.enable_lora:
            bad("lora_modules need enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            bad(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
