"""Shared test setup.

GPU tests carry `@pytest.mark.gpu` and are skipped where CUDA is not available
(CI has no GPU); they run on the device H200 (see gpu/).
"""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the device H200, see gpu/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
