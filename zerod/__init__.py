"""zerod: a host daemon for LLM inference on NVIDIA GPUs, with its own engine bundled."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source tree the rooms `engine/`, `checks/` and `tui/` stand beside this
# package (pyproject.toml maps them to zerod.engine, zerod.checks, zerod.tui when
# installed). Let a plain checkout import them too, e.g. `python3 -m zerod` on a
# GPU host with no install step.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "engine" / "__init__.py").is_file():
    __path__.append(str(_root))  # type: ignore[name-defined]
del _Path, _root
