#!/usr/bin/env python3
"""Launch each Triton kernel of zerod.engine.kernels once, on small shapes, and check it.

Run under compute-sanitizer (gpu/kernels.sh triton):
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 gpu/kernels_memcheck.py
With the caching allocator off every tensor is its own cudaMalloc, so a read or
write past the end of any input, output or workspace is an error the sanitizer
sees (inside one big cached block it would not be). Covers: both RMSNorm
variants, RoPE on strided views, SiLU*mul, KV write (incl. a -1 slot), decode
attention with 1 split (direct) and with 4 splits (partials + reduce) on ragged
lengths crossing pages with a table wider than needed, prefill with cached
prefixes and a sequence with no new tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # zerod from the checkout; kernel_checks

import torch  # noqa: E402

from zerod.engine.kernels import CUDA_KERNELS, IMPORT_ERROR  # noqa: E402
from kernel_checks import (  # noqa: E402
    check_decode, check_prefill, check_rms_norm, check_rope, check_silu, check_write_kv,
)
from zerod.engine.kernels import reference as R  # noqa: E402


def main() -> int:
    if not CUDA_KERNELS:
        print("no kernels:", IMPORT_ERROR)
        return 2
    K, ref, dev = CUDA_KERNELS, R.REFERENCES, torch.device("cuda")
    g = torch.Generator().manual_seed(17)
    bf = torch.bfloat16
    res = [
        check_rms_norm(K["rms_norm"], ref, 3, 1000, bf, dev, g),
        check_rms_norm(K["fused_add_rms_norm"], ref, 3, 4096, bf, dev, g, fused=True),
        check_rope(K["apply_rope"], ref, 5, 32, 8, 128, bf, dev, g, max_pos=64, cache_dtype=bf),
        check_silu(K["silu_and_mul"], ref, 3, 1000, bf, dev, g),
        check_write_kv(K["write_kv"], ref, 9, 8, 128, 16, bf, dev, g, pad=2),
        check_decode(K["decode_attention"], ref, [1, 17, 33, 70], 32, 8, 128, 16, bf, dev, g,
                     width=8, num_splits=1),
        check_decode(K["decode_attention"], ref, [1, 17, 33, 70], 32, 8, 128, 16, bf, dev, g,
                     width=8, num_splits=4),
        check_decode(K["decode_attention"], ref, [300, 5], 14, 2, 64, 16, bf, dev, g),
        check_prefill(K["prefill_attention"], ref, [5, 0, 130], [5, 9, 300], 32, 8, 128, 16, bf, dev, g),
    ]
    # a -1 slot (skipped row) must not be dereferenced
    k = torch.randn(2, 8, 128, device=dev, dtype=bf)
    kc = torch.randn(2, 16, 8, 128, device=dev, dtype=bf)
    vc = kc.clone()
    K["write_kv"](k, k, kc, vc, torch.tensor([-1, 31], device=dev))
    torch.cuda.synchronize()
    ok = all(r.ok for r in res) and torch.equal(kc.view(-1, 8, 128)[31], k[1])
    for r in res:
        print(r.line())
    print("memcheck script:", "all kernels launched and correct" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
