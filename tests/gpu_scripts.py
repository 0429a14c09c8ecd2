"""The scripts of gpu/ as modules, for the tests that check their CPU-side logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "gpu"


def load(name: str):
    """gpu/NAME.py as a module (registered in sys.modules: a dataclass there resolves its
    annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
