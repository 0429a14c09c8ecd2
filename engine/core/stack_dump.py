"""Every thread's Python stack on request: with `ZEROD_STACK_FILE` set (the daemon
sets it for the engines it starts), SIGUSR2 makes the process append all its
threads' stacks to that file. faulthandler writes them from the signal itself, so
the dump comes even when the step thread holds the GIL or the HTTP loop is stuck.
"""

from __future__ import annotations

import faulthandler
import os
import signal

ENV = "ZEROD_STACK_FILE"
SIGNAL = signal.SIGUSR2


def register_from_env(env: dict[str, str] | None = None) -> str | None:
    """Register the dump; returns the file, or None when the variable is unset."""
    path = (os.environ if env is None else env).get(ENV, "")
    if not path:
        return None
    f = open(path, "a", buffering=1)  # noqa: SIM115 - faulthandler keeps it open for the process's life
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    return path
