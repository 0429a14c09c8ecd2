"""Linux's prctl(2), the two uses the engine has for it: naming an OS thread (what
/proc/PID/task/*/comm shows, which the daemon and `zerod bench` read) and ending a child
process with its parent. Both are best effort: elsewhere they do nothing."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_COMM_LEN = 15   # the kernel keeps 16 bytes, the last a NUL


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux
        pass


def set_os_thread_name(name: str) -> None:
    """Name the calling OS thread."""
    _prctl(_PR_SET_NAME, name.encode()[:_COMM_LEN])


def kill_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends. The caller still checks
    os.getppid() after: a parent gone before this call is not covered."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
