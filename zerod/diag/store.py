"""The last `zerod diag` report, kept as JSON at checks.state_dir.diag_result_path:
written by `zerod diag` (and the daemon's runs of it), read by doctor (gpu.diag),
the daemon's control API and /metrics."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from zerod.checks.state_dir import diag_result_path


def save(report: dict[str, Any], path: str | None = None) -> str:
    """Write atomically (a reader never sees half a file); the path written."""
    path = path or diag_result_path()
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".diag-", dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1, default=str)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load(path: str | None = None) -> dict[str, Any] | None:
    """The last report, or None when there is none (or it is unreadable)."""
    try:
        with open(path or diag_result_path()) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("tests"), list) else None
