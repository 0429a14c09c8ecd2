"""The KV page pool: one tensor allocated at start, pages reserved and released by request.

Layout (docs/engine-interface.md): kv[num_layers, 2, num_pages, page_size, Hk, D].
Page 0 is a scratch page (padded graph rows write there); it is never handed out.
reserve/release are O(pages) list operations: nothing is allocated on the device after start.
How many pages there are is sizing.py's business; the pages' dtype is the model's, or
float8_e4m3fn under `--kv-cache-dtype fp8` (the layers' k/v scales live on the model).
"""

from __future__ import annotations

import threading

import torch

from ..config import EngineError
from ..spec.hf_config import ModelConfig
from ..spec.sizing import FP8_KV


def kv_torch_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's torch dtype for sizing.kv_cache_dtype's name."""
    return torch.float8_e4m3fn if kv_dtype == FP8_KV else model_dtype


class KVPool:
    def __init__(self, mc: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        if num_pages < 2:
            raise EngineError(f"KV budget too small: {num_pages} page(s) of {page_size} tokens "
                              f"(need at least 2; raise the memory budget)")
        self.page_size = page_size
        self.num_pages = num_pages
        try:
            self.kv = torch.zeros(mc.num_layers, 2, num_pages, page_size, mc.num_kv_heads,
                                  mc.head_dim, dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            raise EngineError(f"cannot allocate the KV pool ({num_pages} pages) on {device}; "
                              f"lower gpu_memory_utilization use or max_model_len") from None
        self._free = list(range(num_pages - 1, 0, -1))  # stack; page 0 is scratch
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        """Pages a request can get (the scratch page excluded)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def reserve(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            out = self._free[-n:] if n else []
            del self._free[len(self._free) - n:]
            return out[::-1]

    def release(self, pages: list[int]) -> None:
        if not pages:
            return
        with self._lock:
            self._free.extend(reversed(pages))
