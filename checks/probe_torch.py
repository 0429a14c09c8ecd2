"""Probe the installed torch's version and CUDA runtime without importing it.

Importing torch costs seconds and its CUDA initialisation would create a context;
doctor only needs two strings, which torch/version.py holds as plain text.
"""

from __future__ import annotations

import importlib.util
import os
import re

from .facts import Facts


def torch_install() -> dict:
    spec = importlib.util.find_spec("torch")  # finds the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("torch is not installed in this Python")
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def field(name: str) -> str | None:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
        return m.group(1) if m else None

    return {"version": field("__version__"), "cuda": field("cuda"), "hip": field("hip"), "path": path}


def probe(facts: Facts) -> None:
    try:
        info = torch_install()
        facts.put("torch.install", info, info["path"])
    except FileNotFoundError as exc:
        facts.fail("torch.install", str(exc), "importlib.util.find_spec('torch')", missing=True)
    except (OSError, ValueError) as exc:
        facts.fail("torch.install", f"cannot read torch/version.py: {exc}", "torch/version.py")
