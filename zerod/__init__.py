"""zerod: a host daemon for LLM inference on NVIDIA GPUs, with its own engine bundled."""

import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

# What every room may share: this root module alone (tests/test_import_rules.py).
# -h as well as --help, for every command of every zerod CLI (daemon, engine, bench):
# each command names it too, because click caches a command's help option the first
# time it is built (a command invoked alone first would otherwise lose -h).
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

# The rooms stand beside this package in a source tree; pyproject.toml's package-dir
# maps each to zerod.<room> when installed. So that a plain checkout runs too
# (`python3 -m zerod` on a GPU host, no install step), a finder maps exactly these
# folders, and nothing else of the checkout (tests/, gpu/) becomes part of zerod.
ROOMS = ("engine", "checks", "tui", "systemd", "bench")


class _CheckoutRooms:
    """Meta-path finder: `zerod.<room>` -> `<checkout>/<room>/`."""

    def __init__(self, root: _Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        package, _, room = name.partition(".")
        if package != __name__ or room not in ROOMS:
            return None
        folder = self.root / room
        if (folder / "__init__.py").is_file():
            return _util.spec_from_file_location(name, folder / "__init__.py",
                                                 submodule_search_locations=[str(folder)])
        if folder.is_dir():  # data only (systemd/): a namespace package
            spec = _machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        return None


_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and not any(
        isinstance(f, _CheckoutRooms) for f in _sys.meta_path):
    _sys.meta_path.append(_CheckoutRooms(_root))  # after the installed finders
del _root
