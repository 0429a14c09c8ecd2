"""Where zerod keeps what must outlive a process: the last `zerod diag` result, doctor's
last report, the daemon's events and the flight recorder's bundles.

One rule for every reader and writer: `[daemon] state_dir` when set; else
`$ZEROD_STATE_DIR` (tests, and hosts that keep state elsewhere); else the unit's
StateDirectory (`$STATE_DIRECTORY`); `/var/lib/zerod` as root; and
`$XDG_STATE_HOME/zerod` (`~/.local/state/zerod`) for anyone else, so a user's
`zerod diag` or `zerod doctor` never needs root to keep its result.
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
    if env.get("ZEROD_STATE_DIR"):
        return env["ZEROD_STATE_DIR"]
    unit_dir = env.get("STATE_DIRECTORY")  # systemd's StateDirectory=zerod
    if unit_dir:
        return unit_dir.split(":")[0]
    if euid == 0:
        return ROOT_STATE_DIR
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(env.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state"), "zerod")


def diag_result_path(configured: str | None = None, env: dict[str, str] | None = None,
                     euid: int | None = None) -> str:
    """The file holding the last `zerod diag` report (JSON, the shape `zerod diag --json` prints)."""
    return os.path.join(state_dir(configured, env, euid), DIAG_RESULT_FILE)
