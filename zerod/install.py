"""`zerod install`: the unit with the real ExecStart path, the sysctl drop-in
(the same text `zerod harden` writes), a NUMA drop-in for this host's GPU, and
the example config when none exists. `--rootfs DIR` writes under DIR (images,
tests), every path resolved inside it (checks/rootfs.py); `--dry-run` shows
everything and writes nothing.

The config may hold the API key: it is written 0640, root and the `zerod` group
where the system has one. The unit hands it (and /etc/zerod/api_key) to the
daemon's dynamic user as systemd credentials, so the daemon never needs to read
the file itself (docs/install.md).
"""

from __future__ import annotations

import grp
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from zerod import numa
from zerod.checks.pci import normalize_bdf
from zerod.checks.rootfs import RootEscape, resolve_in_root
from zerod.daemon_config import default_socket

UNIT = "etc/systemd/system/zerod.service"
NUMA_DROPIN = "etc/systemd/system/zerod.service.d/50-numa.conf"
SYSCTL_DROPIN = "etc/sysctl.d/60-zerod.conf"
CONFIG = "etc/zerod/zerod.toml"
CONFIG_MODE = 0o640  # it may hold the API key
CONFIG_GROUP = "zerod"  # operators (and a static zerod user) read the config through it
# The daemon reads its config as a credential (see systemd/zerod.service).
UNIT_CONFIG = "${CREDENTIALS_DIRECTORY}/zerod.toml"
# systemd/ beside the package in a checkout; zerod/systemd/ in an installed wheel.
DATA = next((d for d in (Path(__file__).resolve().parent.parent / "systemd",
                         Path(__file__).resolve().parent / "systemd") if (d / "zerod.service").is_file()),
            Path(__file__).resolve().parent / "systemd")


class InstallError(Exception):
    pass


@dataclass
class PlannedFile:
    path: str
    content: str
    mode: int = 0o644
    keep_existing: bool = False  # the config: never overwrite a person's file
    group: int | None = None  # the file's group when run as root (owner root); None: root


@dataclass
class Plan:
    files: list[PlannedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _data(name: str) -> str:
    p = DATA / name
    try:
        return p.read_text()
    except OSError as exc:
        raise InstallError(f"cannot read {p} ({exc.strerror}): run zerod install from a source checkout "
                           f"or an install that ships systemd/") from None


def default_exec_start() -> str:
    """This zerod's own entry point: the console script next to this Python,
    else the interpreter with -m zerod."""
    candidates = [os.path.join(os.path.dirname(sys.executable), "zerod"), shutil.which("zerod")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return shlex.quote(os.path.abspath(c))
    return f"{shlex.quote(sys.executable)} -m zerod"


# Directories the unit's sandbox hides from the service (systemd/zerod.service): a
# program, its interpreter or its package there is not found when the unit starts.
HIDDEN = (("/home/", "ProtectHome=yes", "add ProtectHome=read-only in a drop-in"),
          ("/root/", "ProtectHome=yes", "add ProtectHome=read-only in a drop-in"),
          ("/run/user/", "ProtectHome=yes", "add ProtectHome=read-only in a drop-in"),
          ("/tmp/", "PrivateTmp=yes", "a private /tmp replaces it"),
          ("/var/tmp/", "PrivateTmp=yes", "a private /var/tmp replaces it"))


def hidden_by_unit(program: str) -> list[str]:
    """Warnings for each path the service needs that its sandbox hides: the ExecStart
    program, where its links lead, the interpreter of its #! line, and zerod's package."""
    paths = []
    if program:
        paths += [("ExecStart", program), ("ExecStart", os.path.realpath(program))]
        interpreter = _shebang(program)
        if interpreter:
            paths += [("its interpreter", interpreter), ("its interpreter", os.path.realpath(interpreter))]
    paths.append(("the zerod package", os.path.dirname(os.path.realpath(__file__))))
    notes, said = [], set()
    for what, path in paths:
        for prefix, setting, fix in HIDDEN:
            if (path + "/").startswith(prefix) and (what, setting) not in said:
                said.add((what, setting))
                notes.append(f"{what} {path} is under {prefix.rstrip('/')}, which the unit hides "
                             f"({setting}): the service would not find it; install zerod "
                             f"system-wide (e.g. a venv in /opt/zerod), or {fix}")
    return notes


def _shebang(program: str) -> str | None:
    try:
        with open(program, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return None
    return words[1] if os.path.basename(words[0]) == "env" and len(words) > 1 and "/" in words[1] else words[0]


def render_unit(exec_start: str) -> str:
    text = _data("zerod.service")
    line = f"ExecStart={exec_start} run --config {UNIT_CONFIG}"
    out, n = re.subn(r"^ExecStart=.*$", lambda _m: line, text, flags=re.M)
    if n != 1:
        raise InstallError("systemd/zerod.service must hold exactly one ExecStart= line")
    return out


def sysctl_text() -> str:
    try:
        from zerod.checks.harden import sysctl_dropin_text
    except ImportError:
        return _data("60-zerod.conf")
    return sysctl_dropin_text()


def gpu_bus_id(gpu_index: int, nvml=None) -> str | None:
    from zerod.watchers.nvml_session import NvmlSession

    s = NvmlSession(nvml, retry_s=0)
    if s.ensure():
        dev = s.device(gpu_index)
        s.close()
        return dev.bus_id if dev else None
    return None


def numa_dropin(gpu_index: int, bus_id: str | None, sysfs: str = "/sys") -> tuple[str, str]:
    """(text, note). Pins the whole service (daemon and engine) to the GPU's
    node; the daemon also pins the engine itself, so this is belt and braces."""
    head = ["# Written by `zerod install`: the service runs on the NUMA node of the GPU it serves.",
            "# Re-run `zerod install` after moving the GPU or changing [daemon] gpu_index.",
            "[Service]"]
    if not bus_id:
        return "\n".join(head + [f"# GPU {gpu_index}: no PCI address (NVML unavailable here): nothing pinned."]) + "\n", \
            f"GPU {gpu_index} not found through NVML: the NUMA drop-in pins nothing"
    b = numa.plan_binding(bus_id, "bind", sysfs, allowed=set(range(4096)))
    if not b.active:
        return "\n".join(head + [f"# GPU {gpu_index} ({normalize_bdf(bus_id)}): {b.reason}."]) + "\n", b.reason
    lines = head + [f"# GPU {gpu_index} ({normalize_bdf(bus_id)}) is on NUMA node {b.node}.",
                    f"CPUAffinity={b.cpulist}", "NUMAPolicy=bind", f"NUMAMask={b.node}"]
    return "\n".join(lines) + "\n", f"service pinned to NUMA node {b.node} (CPUs {b.cpulist})"


def config_group(rootfs: str = "/") -> int | None:
    """The gid of the installed system's `zerod` group (its /etc/group under --rootfs), or None."""
    if os.path.realpath(rootfs) == "/":
        try:
            return grp.getgrnam(CONFIG_GROUP).gr_gid
        except KeyError:
            return None
    try:
        with open(_in_root(rootfs, "etc/group")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split(":")
        if name == CONFIG_GROUP and len(fields) >= 2 and fields[1].isdigit():
            return int(fields[1])
    return None


def _in_root(rootfs: str, rel: str) -> str:
    try:
        return resolve_in_root(rootfs, rel)
    except RootEscape as exc:
        raise InstallError(str(exc)) from None


def plan_install(rootfs: str = "/", exec_start: str | None = None, gpu_index: int = 0,
                 sysfs: str = "/sys", nvml=None, bus_id: str | None = None) -> Plan:
    root = os.path.abspath(rootfs)
    plan = Plan()
    exe = exec_start or default_exec_start()
    plan.files.append(PlannedFile(_in_root(root, UNIT), render_unit(exe)))
    plan.notes += hidden_by_unit(shlex.split(exe)[0] if exe else "")
    plan.files.append(PlannedFile(_in_root(root, SYSCTL_DROPIN), sysctl_text()))
    if bus_id is None:
        bus_id = gpu_bus_id(gpu_index, nvml)
    text, note = numa_dropin(gpu_index, bus_id, sysfs)
    plan.notes.append(note)
    plan.files.append(PlannedFile(_in_root(root, NUMA_DROPIN), text))
    gid = config_group(root)
    plan.files.append(PlannedFile(_in_root(root, CONFIG), _data("zerod.toml.example"), CONFIG_MODE,
                                  keep_existing=True, group=gid))
    plan.notes.append(f"/{CONFIG} is mode {CONFIG_MODE:o}, owner root, group "
                      + (CONFIG_GROUP if gid is not None else f"root (no '{CONFIG_GROUP}' group)")
                      + "; the daemon reads it, and /etc/zerod/api_key, as systemd credentials")
    # the unit's RuntimeDirectory=zerod: where the daemon binds and `zerod top` looks
    plan.notes.append(f"control socket: {default_socket({'RUNTIME_DIRECTORY': '/run/zerod'})} (zerod top, as root)")
    return plan


def _own(path_or_fd, f: PlannedFile) -> None:
    """Mode, and as root the owner root and the planned group (else root's)."""
    os.chmod(path_or_fd, f.mode)
    if os.geteuid() == 0:
        os.chown(path_or_fd, 0, f.group if f.group is not None else 0)


def write_plan(plan: Plan) -> list[tuple[str, str]]:
    done: list[tuple[str, str]] = []
    for f in plan.files:
        try:
            if f.keep_existing and os.path.exists(f.path):
                loose = os.stat(f.path).st_mode & 0o7777 & ~f.mode
                if loose:  # a config from an older install, readable by everyone: close it
                    _own(f.path, f)
                done.append((f.path, f"kept (exists){f', now mode {f.mode:o}' if loose else ''}"))
                continue
            os.makedirs(os.path.dirname(f.path), exist_ok=True)
            tmp = f"{f.path}.zerod-tmp"
            # Created with its final mode: the config is never readable by others, not even briefly.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, f.mode)
            with os.fdopen(fd, "w") as fh:
                _own(fh.fileno(), f)
                fh.write(f.content)
            os.replace(tmp, f.path)
        except PermissionError as exc:
            raise InstallError(f"cannot write {f.path}: {exc.strerror} (run as root: sudo zerod install)") from None
        except OSError as exc:
            raise InstallError(f"cannot write {f.path}: {exc}") from None
        done.append((f.path, "wrote"))
    return done
