"""Free space where zerod writes: the model's directory (a download or a conversion
lands there), the Hugging Face and Triton caches, and the state directory."""

from __future__ import annotations

import os

from .facts import Facts, Roots
from .state_dir import state_dir as default_state_dir


def directories(env: dict[str, str], model: str | None, state_dir: str | None) -> dict[str, str]:
    """What each directory is for -> its path (as configured or defaulted)."""
    home = env.get("HOME") or os.path.expanduser("~")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    out = {"huggingface cache": env.get("HF_HOME") or os.path.join(cache, "huggingface"),
           "triton cache": env.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton"),
           "state directory": default_state_dir(state_dir, env)}
    if model and model != "demo" and (os.path.isabs(model) or os.path.exists(model)):
        out["model"] = model
    return out


def _nearest_existing(path: str) -> str:
    """The directory itself, or its closest existing parent (a cache not made yet lands there)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


def probe(facts: Facts, roots: Roots, model: str | None, state_dir: str | None) -> None:
    rows = []
    for what, path in directories(dict(os.environ), model, state_dir).items():
        target = path if roots.live else roots.root(path)
        at = _nearest_existing(target)
        try:
            st = os.statvfs(at)
        except OSError as exc:
            rows.append({"what": what, "path": path, "statvfs": at, "error": str(exc)})
            continue
        rows.append({"what": what, "path": path, "statvfs": at, "free_bytes": st.f_bavail * st.f_frsize,
                     "total_bytes": st.f_blocks * st.f_frsize})
    facts.put("disk.free", rows, "statvfs() of each directory (or its nearest existing parent)")
