"""Launching a compiled Triton kernel again without the JIT's per-call work.

`kernel[grid](*args)` binds every argument, specializes it, builds and hashes a cache key
and reads the launch options on every call: tens of microseconds of Python, which an
eager forward pays at each of its launches (the LoRA path adds one per projection, 128 a
forward at the 8B shape). `FastLaunch(kernel)[grid](*args, **constexprs)` does the same
launch: the first call with a given `spec` of the arguments goes through the JIT (which
compiles and checks everything) and keeps the compiled kernel it returns; later calls
with that spec launch it directly. The spec covers all that Triton specializes a
compiled kernel on, and more (over-keying only costs one more trip through the JIT):
each tensor's dtype, device and 16-byte alignment, each int's equality to 1,
divisibility by 16 and 32-bit range, the constexprs and options. (Host costs on the
H200 host: docs/perf.md section 15.) Under Triton's interpreter, or where the JIT
returns no compiled kernel, every call goes through the JIT.
"""

from __future__ import annotations

import torch

ENABLED = True   # False: every launch through the JIT (gpu/lora_eager_bench.py times both)


def _spec(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.device, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or not isinstance(a, int):
        return type(a), a if isinstance(a, bool) else None
    return a == 1, a % 16 == 0, -2**31 <= a < 2**31


class FastLaunch:
    def __init__(self, kernel):
        self.kernel = kernel
        self.names = getattr(kernel, "arg_names", ())   # the signature's order, constexprs included
        self.compiled: dict[tuple, object] = {}

    def __getitem__(self, grid):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid, args: tuple, kw: dict) -> None:
        if not ENABLED:
            self.kernel[grid](*args, **kw)
            return
        key = (tuple(map(_spec, args)), tuple(kw.items()))
        c = self.compiled.get(key)
        if c is None:
            c = self.kernel[grid](*args, **kw)
            if hasattr(c, "run") and hasattr(c, "packed_metadata"):   # a compiled GPU kernel
                self.compiled[key] = c
            return
        # the launch the JIT makes, with the values of every parameter in signature order
        c[grid](*args, *(kw[n] for n in self.names[len(args):]))
