"""First uses after READY: the Triton kernels this process builds (a JIT compile, or a load
from the on-disk cache) and the modules it imports. The warm-up makes both zero for
everything serving reaches; these counters are how the engine (a slow step's reason, the
start log) and the tests (tests/test_warmup.py) see that it does."""

from __future__ import annotations

import sys
import threading


class FirstUses:
    def __init__(self) -> None:
        self.kernels_built = 0
        self.last_kernel = ""
        self._lock = threading.Lock()
        self._installed = False
        self._modules_at_ready: set[str] | None = None

    def install(self) -> None:
        """Count Triton's kernel builds (its post-compile hook, chained to any other)."""
        if self._installed:
            return
        self._installed = True
        try:
            from triton import knobs
        except ImportError:   # no Triton (or one without knobs): nothing of it to build
            return
        prev = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            with self._lock:
                self.kernels_built += 1
                self.last_kernel = str(kwargs.get("repr", ""))[:200]
            return prev(*args, **kwargs) if prev else None

        knobs.runtime.jit_post_compile_hook = hook

    def mark_ready(self) -> None:
        self._modules_at_ready = set(sys.modules)

    def imported_since_ready(self) -> list[str]:
        if self._modules_at_ready is None:
            return []
        return sorted(set(sys.modules) - self._modules_at_ready)


FIRST_USES = FirstUses()   # one per process: Triton's cache and sys.modules are the process's
