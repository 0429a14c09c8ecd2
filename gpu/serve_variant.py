"""The A/B wrappers' shared part (gpu/*_serve.py): `zerod serve` from the checkout,
uninstalled, after one named variant has set the module knobs it is about.

    python3 gpu/X_serve.py VARIANT serve ARGS...
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout, uninstalled


def serve(script: str, variants: dict[str, Callable[[], None]]) -> None:
    """Apply sys.argv[1]'s variant, then run the zerod CLI on the rest of the arguments."""
    variant = sys.argv[1] if len(sys.argv) > 1 else ""
    if variant not in variants:
        sys.exit(f"usage: {script} {{{','.join(variants)}}} serve ARGS...")
    variants[variant]()
    sys.argv = ["zerod"] + sys.argv[2:]
    from zerod.cli import main as zerod_main
    zerod_main()
