"""Doctor's last report on disk, so `zerod top` has a host verdict to show when no
daemon is running (the daemon serves its own through /v1/checks).

`zerod doctor` (a full run) and the daemon's preflight each write it, best effort, in
the state directory (checks/state_dir.py); a host where neither can write still works,
it only has nothing to show. A reader takes the newest of its own state directory's and
root's (a user looking at what the root daemon wrote).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .state_dir import ROOT_STATE_DIR, state_dir

NAME = "doctor-last.json"
SYSTEM_DIR = Path(ROOT_STATE_DIR)


def write_path() -> Path:
    return Path(state_dir()) / NAME


def read_paths() -> tuple[Path, ...]:
    own = write_path()
    system = SYSTEM_DIR / NAME
    return (own,) if own == system or os.environ.get("ZEROD_STATE_DIR") else (own, system)


def save(doc: dict[str, Any], taken_at: float | None = None) -> str | None:
    """Write `doc` (Report.to_dict()) with its `taken_at`; the error in words, or None."""
    path = write_path()
    body = json.dumps({**doc, "taken_at": time.time() if taken_at is None else taken_at}, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".doctor-", delete=False) as f:
            f.write(body)
        os.chmod(f.name, 0o644)  # a verdict on the host, readable by whoever looks at it
        os.replace(f.name, path)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def load(paths: tuple[Path, ...] | None = None) -> dict[str, Any] | None:
    """The newest readable report (with `taken_at` and `path`), or None."""
    best: dict[str, Any] | None = None
    for path in paths or read_paths():
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
            continue
        taken = doc.get("taken_at")
        if not isinstance(taken, (int, float)):
            continue
        if best is None or taken > best["taken_at"]:
            best = {**doc, "path": str(path)}
    return best
