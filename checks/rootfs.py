"""Paths under a `--rootfs DIR` that cannot lead out of it.

`zerod harden` and `zerod install` write system files under DIR (an image being
built, a test tree). A symlink in DIR that is absolute (`etc/sysctl.d -> /etc/sysctl.d`)
or climbs above DIR with `..` would make a plain open() write to the host running the
command instead: such a path is refused. Relative links that stay inside DIR (sysfs'
`cpu0/cpufreq -> ../cpufreq/policy0`) are followed. On `/` itself nothing can escape.
"""

from __future__ import annotations

import os

MAX_LINKS = 40  # the kernel's own limit on links followed in one lookup


class RootEscape(Exception):
    """A path under --rootfs leads outside it; nothing was written."""


def resolve_in_root(rootfs: str, rel: str) -> str:
    """The real path of `rel` (relative to the root, or absolute as seen inside it)
    under `rootfs`, every symlink followed and kept inside; missing tail components
    are fine (they are what gets created). Raises RootEscape."""
    root = os.path.realpath(rootfs)
    if root == "/":
        return os.path.normpath("/" + rel)
    path, pending, links = root, [p for p in rel.split("/") if p], 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            if path == root:
                raise RootEscape(f"{rel} climbs above --rootfs {root}: refusing to write outside it")
            path = os.path.dirname(path)
            continue
        step = os.path.join(path, part)
        if not os.path.islink(step):
            path = step
            continue
        target = os.readlink(step)
        if os.path.isabs(target):
            raise RootEscape(f"{step} is a symlink to the absolute path {target}: under --rootfs {root} "
                             f"it would lead outside it; make it relative or remove it (nothing was written)")
        links += 1
        if links > MAX_LINKS:
            raise RootEscape(f"too many symlinks resolving {rel} under --rootfs {root} (a loop?)")
        pending[:0] = [p for p in target.split("/") if p]
    return path


def inside_root(rootfs: str, path: str) -> str:
    """A path recorded earlier as resolved under `rootfs`, checked again now (a link
    may have been planted since). Raises RootEscape."""
    root = os.path.realpath(rootfs)
    rel = os.path.relpath(path, root)
    if rel == ".." or rel.startswith("../"):
        raise RootEscape(f"{path} is not under --rootfs {root}")
    return resolve_in_root(rootfs, rel)
