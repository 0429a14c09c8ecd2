"""Pin the engine to its GPU's NUMA node.

The node comes from sysfs (`/sys/bus/pci/devices/<bdf>/numa_node`), its CPUs from
`/sys/devices/system/node/nodeN/cpulist`. The binding is applied in the child
before it becomes the engine: the daemon starts `python -m zerod.numa --cpus …
--mem-node N -- <engine argv>`, which sets the CPU affinity
(sched_setaffinity) and the memory policy (set_mempolicy through ctypes) and
then exec()s the engine — so the engine's pid is this shim's pid, and no
preexec_fn runs in a threaded parent. `numactl` is used instead where asked
for and present.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from zerod.checks.cpulist import parse_cpulist
from zerod.checks.pci import normalize_bdf

MPOL_PREFERRED = 1
MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261}


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def gpu_numa_node(bus_id: str, sysfs: str | os.PathLike[str] = "/sys") -> int | None:
    """The NUMA node of a PCI device, or None when sysfs does not say (-1)."""
    path = Path(sysfs) / "bus/pci/devices" / normalize_bdf(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if node < 0:
        # No NUMA information: on a one-node host that is node 0.
        nodes = online_nodes(sysfs)
        return 0 if nodes == [0] else None
    return node


def online_nodes(sysfs: str | os.PathLike[str] = "/sys") -> list[int]:
    try:
        return parse_cpulist((Path(sysfs) / "devices/system/node/online").read_text())
    except (OSError, ValueError):
        return []


def node_cpus(node: int, sysfs: str | os.PathLike[str] = "/sys") -> list[int]:
    try:
        return parse_cpulist((Path(sysfs) / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return []


@dataclass
class Binding:
    node: int | None
    cpus: list[int]
    policy: str = "bind"  # or "preferred"
    reason: str = ""

    @property
    def active(self) -> bool:
        return self.node is not None and bool(self.cpus)

    @property
    def cpulist(self) -> str | None:
        return format_cpulist(self.cpus) if self.cpus else None


def plan_binding(bus_id: str | None, policy: str = "bind", sysfs: str = "/sys",
                 allowed: set[int] | None = None) -> Binding:
    """Where the engine should run: its GPU's node, limited to the CPUs this
    process may use (a cgroup cpuset can be narrower than the node)."""
    if not bus_id:
        return Binding(None, [], policy, "GPU PCI address unknown (no NVML): not pinned")
    node = gpu_numa_node(bus_id, sysfs)
    if node is None:
        return Binding(None, [], policy, f"sysfs gives no NUMA node for {normalize_bdf(bus_id)}: not pinned")
    cpus = node_cpus(node, sysfs)
    if allowed is None:
        try:
            allowed = os.sched_getaffinity(0)
        except OSError:
            allowed = set(cpus)
    usable = sorted(set(cpus) & set(allowed))
    if not usable:
        return Binding(node, [], policy,
                       f"none of node {node}'s CPUs ({format_cpulist(cpus) or '?'}) are allowed here: not pinned")
    return Binding(node, usable, policy, f"GPU {normalize_bdf(bus_id)} is on NUMA node {node}")


def wrap_command(argv: list[str], binding: Binding, tool: str = "builtin") -> list[str]:
    """The engine's argv with the binding applied before exec. The builtin shim
    also ties the engine's life to the daemon (PR_SET_PDEATHSIG), so a daemon
    killed outright does not leave an engine holding the GPU."""
    if tool == "numactl" and binding.active:
        numactl = shutil.which("numactl")
        if numactl:
            mem = f"--membind={binding.node}" if binding.policy == "bind" else f"--preferred={binding.node}"
            return [numactl, f"--physcpubind={binding.cpulist}", mem, "--", *argv]
    cmd = [sys.executable, "-m", "zerod.numa", "--parent", str(os.getpid())]
    if binding.active:
        cmd += ["--cpus", binding.cpulist or "", "--mem-node", str(binding.node), "--policy", binding.policy]
    return [*cmd, "--", *argv]


def _die_with_parent(parent: int) -> None:
    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, 15, 0, 0, 0)  # SIGTERM: the engine drains
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent went before prctl took effect
        print(f"zerod.numa: parent {parent} is gone; not starting", file=sys.stderr)
        os._exit(1)


def set_mempolicy(node: int, policy: str = "bind") -> None:
    """Bind (or prefer) this process's future memory allocations to one node."""
    nr = _SYS_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        raise OSError(f"set_mempolicy: unknown syscall number on {platform.machine()}")
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    mode = MPOL_BIND if policy == "bind" else MPOL_PREFERRED
    # maxnode counts bits plus one (the kernel decrements it first).
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(mode), mask, ctypes.c_ulong(words * 64 + 1))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy({policy}, node {node}): {os.strerror(err)}")


def main(argv: list[str] | None = None) -> None:
    """`python -m zerod.numa [--parent PID] [--cpus LIST --mem-node N [--policy bind|preferred]] -- CMD…`"""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        sys.exit("usage: python -m zerod.numa [--parent PID] [--cpus LIST --mem-node N [--policy P]] -- CMD ...")
    split = args.index("--")
    opts, cmd = args[:split], args[split + 1:]
    values = dict(zip(opts[::2], opts[1::2]))
    if not cmd:
        sys.exit("zerod.numa: no command given")
    if values.get("--parent"):
        _die_with_parent(int(values["--parent"]))
    cpus = values.get("--cpus")
    if cpus:
        try:
            os.sched_setaffinity(0, parse_cpulist(cpus))
        except OSError as exc:
            print(f"zerod.numa: CPU affinity {cpus} not applied: {exc}", file=sys.stderr)
    node = values.get("--mem-node")
    if node is not None:
        try:
            set_mempolicy(int(node), values.get("--policy", "bind"))
        except OSError as exc:
            print(f"zerod.numa: memory policy for node {node} not applied: {exc}", file=sys.stderr)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
