"""Doctor's last report on disk, so `zerod top` has a host verdict to show when no
daemon is running (the daemon serves its own through /v1/checks).

`zerod doctor` (a full run) and the daemon's preflight each write it, best effort:
a host where neither can write still works, it only has nothing to show. Root
writes under /var/lib/zerod, another user under its XDG state directory; a reader
takes the newest of the two it can read. `ZEROD_STATE_DIR` replaces both (tests, and
hosts that keep state elsewhere).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "doctor-last.json"
SYSTEM_DIR = Path("/var/lib/zerod")


def user_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "zerod"


def write_path() -> Path:
    override = os.environ.get("ZEROD_STATE_DIR")
    if override:
        return Path(override) / NAME
    return (SYSTEM_DIR if os.geteuid() == 0 else user_dir()) / NAME


def read_paths() -> tuple[Path, ...]:
    override = os.environ.get("ZEROD_STATE_DIR")
    if override:
        return (Path(override) / NAME,)
    return (SYSTEM_DIR / NAME, user_dir() / NAME)


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
