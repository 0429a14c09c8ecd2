"""Could another local user swap the control socket? Checked as OpenSSH's StrictModes
checks the path of a key file: every directory from the socket's up to / must belong to
this user or root, and one that others may write must have the sticky bit (others then
cannot rename or replace what this user owns in it). The socket's own directory must be
this user's alone. Used by the daemon before it binds and by `zerod top` before it
connects: a socket a stranger could have put there is never trusted. Standard library
only (the dashboard's client imports it)."""

from __future__ import annotations

import os
import stat


def chain_problem(socket_path: str, euid: int | None = None, own_dir: bool = True) -> str | None:
    """Why the directories holding `socket_path` are unsafe, naming the directory, or
    None. own_dir: the socket's directory must belong to `euid` itself (the daemon's
    side); otherwise to `euid` or root (a client, which may reach a root daemon)."""
    euid = os.geteuid() if euid is None else euid
    trusted = {euid, 0}
    parent = os.path.dirname(os.path.realpath(socket_path))
    d = parent
    while True:
        try:
            st = os.stat(d)
        except OSError as exc:
            return f"cannot check control socket directory {d}: {exc.strerror or exc}"
        mode = stat.S_IMODE(st.st_mode)
        if d == parent and own_dir and st.st_uid != euid:
            return (f"control socket directory {d} belongs to uid {st.st_uid}, not to this "
                    f"daemon's user (uid {euid}): set [daemon] control_socket in a directory "
                    "of its own")
        if st.st_uid not in trusted:
            return (f"control socket directory {d} belongs to uid {st.st_uid} (neither uid "
                    f"{euid} nor root): that user could swap the socket; use a directory "
                    "chain only this user or root controls")
        writable = mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and (d == parent or not mode & stat.S_ISVTX):
            return (f"control socket directory {d} is writable by others (mode {mode:04o}"
                    f"{', not sticky' if d != parent else ''}): another user could swap the "
                    "socket; set [daemon] control_socket in a directory only this user can write")
        up = os.path.dirname(d)
        if up == d:
            return None
        d = up


def socket_owner_problem(socket_path: str, euid: int | None = None) -> str | None:
    """A client's check of the socket itself: it must belong to this user or root."""
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.lstat(socket_path)
    except OSError:
        return None   # connecting says what is missing
    if not stat.S_ISSOCK(st.st_mode):
        return f"{socket_path} is not a socket"
    if st.st_uid not in (euid, 0):
        return (f"control socket {socket_path} belongs to uid {st.st_uid}, neither this user "
                f"(uid {euid}) nor root: not the daemon's; refusing to talk to it")
    return None
