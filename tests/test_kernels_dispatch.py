"""The kernel table and the decode split heuristic, on any machine (no GPU, no Triton needed)."""

from __future__ import annotations

import pytest


def test_kernel_table_fails_soft_without_cuda():
    import torch

    from zerod.engine.kernels import CUDA_KERNELS, IMPORT_ERROR, KERNEL_NAMES

    assert isinstance(CUDA_KERNELS, dict)
    assert len(KERNEL_NAMES) == 8
    if not torch.cuda.is_available():
        assert CUDA_KERNELS == {}
        assert IMPORT_ERROR
    else:
        assert set(CUDA_KERNELS) == set(KERNEL_NAMES)


def test_references_cover_every_kernel():
    from zerod.engine.kernels import KERNEL_NAMES
    from zerod.engine.kernels.reference import REFERENCES

    assert set(REFERENCES) == set(KERNEL_NAMES)


def test_decode_splits_depend_on_shapes_only():
    pytest.importorskip("triton")
    from zerod.engine.kernels.decode_attention import choose_num_splits

    w = 1056 * 16  # block-table width of a captured bucket at max_model_len 16.9K
    got = {b: choose_num_splits(b, 8, w, 132) for b in (1, 2, 4, 8, 16, 32, 64, 200)}
    assert got == {1: 64, 2: 64, 4: 32, 8: 16, 16: 4, 32: 2, 64: 1, 200: 1}
    # a short table caps the splits (each split gets >= 256 tokens of the table)
    assert choose_num_splits(1, 8, 512, 132) == 2
    assert choose_num_splits(1, 8, 16, 132) == 1
