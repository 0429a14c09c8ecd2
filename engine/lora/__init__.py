"""Multi-LoRA: adapters in the PEFT format served beside the base model, chosen per request.

- adapter.py reads and checks one PEFT adapter (host tensors);
- slabs.py holds the fixed device buffers every adapter is written into, and the per-token
  adapter rows of the forward being run (what `Linear` reads);
- delta.py adds an adapter's delta to a projection's output (Triton on CUDA, torch otherwise);
- manager.py keeps the registered adapters, the host and device LRUs, and the slots.

docs/design.md's LoRA section says how they fit together.
"""

from .adapter import LoraAdapter, LoraError, read_adapter
from .manager import LoraManager, parse_lora_module

__all__ = ["LoraAdapter", "LoraError", "LoraManager", "parse_lora_module", "read_adapter"]
