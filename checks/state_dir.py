"""Where zerod keeps what must outlive a process: the last `zerod diag` result (and
what else the daemon stores beside it).

One rule for every reader and writer: `[daemon] state_dir` when set; else the
unit's StateDirectory (`$STATE_DIRECTORY`), `/var/lib/zerod` as root, and
`$XDG_CACHE_HOME/zerod` (`~/.cache/zerod`) for anyone else, so a user's
`zerod diag` never needs root to keep its result.
"""

from __future__ import annotations

import os

ROOT_STATE_DIR = "/var/lib/zerod"
DIAG_RESULT_FILE = "diag.json"


def state_dir(configured: str | None = None, env: dict[str, str] | None = None,
              euid: int | None = None) -> str:
    if configured:
        return configured
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    unit_dir = env.get("STATE_DIRECTORY")  # systemd's StateDirectory=zerod
    if unit_dir:
        return unit_dir.split(":")[0]
    if euid == 0:
        return ROOT_STATE_DIR
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zerod")


def diag_result_path(configured: str | None = None, env: dict[str, str] | None = None,
                     euid: int | None = None) -> str:
    """The file holding the last `zerod diag` report (JSON, the shape `zerod diag --json` prints)."""
    return os.path.join(state_dir(configured, env, euid), DIAG_RESULT_FILE)
