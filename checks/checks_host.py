"""Host checks: kernel, NUMA, memory, swap, CPU frequency."""

from __future__ import annotations

from .checks_gpu import version_tuple
from .cpulist import parse_cpulist
from .report import FAIL, PASS, SKIP, WARN, Ctx, check

HARDEN = "`sudo zerod harden --apply` does this"
# mem.swap: with swap on, a vm.swappiness above this lets the kernel page out anonymous
# memory early rather than only under real pressure.
MAX_SWAPPINESS = 10


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


@check("kernel.version", "Kernel >= 5.10 (5.15+ recommended)", "critical")
def kernel_version(ctx: Ctx):
    rel = ctx.fact("kernel.release")
    v = version_tuple(rel)
    low, rec = ctx.cfg.min_kernel_version, ctx.cfg.recommended_kernel_version
    fix = "upgrade to a supported distribution kernel (e.g. Ubuntu 22.04+ HWE, RHEL 9) and reboot"
    if not v:
        return WARN(f"cannot parse kernel release {rel!r}", fix)
    if v < version_tuple(low):
        return FAIL(f"kernel {rel} is older than {low}: old cgroup and "
                    "NVIDIA open-driver support", fix)
    if v < version_tuple(rec):
        return WARN(f"kernel {rel} is older than the recommended {rec}", fix)
    return PASS(f"kernel {rel} >= {rec}")


@check("kernel.io_uring", "io_uring state (zerod does not use it)", "minor")
def io_uring(ctx: Ctx):
    """Reported, never failed: nothing in zerod (daemon, engine, model loading) uses
    io_uring, and a host that disables it does so on purpose (a security control on many
    fleets), so its state is information for the operator, not a gate."""
    cfg = ctx.facts.get("kernel.config")
    disabled = ctx.optional("kernel.io_uring_disabled")
    unused = "zerod does not use io_uring (its reads are plain file I/O), so nothing to change"
    if cfg.ok:
        ctx.ev("kernel.config", cfg.value, cfg.source)
        if cfg.value.get("CONFIG_IO_URING", "n") != "y":
            return PASS(f"CONFIG_IO_URING={cfg.value.get('CONFIG_IO_URING', 'n')} "
                        f"({cfg.source}): not built; {unused}")
    elif disabled is None:
        ctx.ev("kernel.config", None, cfg.source, error=cfg.error)
        return SKIP(f"cannot tell: {cfg.error}; no /proc/sys/kernel/io_uring_disabled either")
    if disabled == 2:
        return PASS(f"kernel.io_uring_disabled = 2: io_uring is off for every process (a "
                    f"security setting, left as it is); {unused}")
    if disabled == 1:
        return PASS("kernel.io_uring_disabled = 1: only the kernel.io_uring_group may use "
                    f"io_uring; {unused}")
    how = "CONFIG_IO_URING=y" if cfg.ok else "io_uring_disabled exists"
    return PASS(f"{how}; kernel.io_uring_disabled = {disabled if disabled is not None else 'n/a (< 6.6)'}"
                "; zerod does not use io_uring")


@check("kernel.numa_balancing", "Automatic NUMA balancing off", "major")
def numa_balancing(ctx: Ctx):
    v = ctx.fact("kernel.numa_balancing")
    if v != 0:
        return FAIL(f"kernel.numa_balancing = {v}: the kernel unmaps and migrates the engine's pages "
                    "between nodes, adding latency spikes to pinned, GPU-fed memory",
                    "`sudo sysctl -w kernel.numa_balancing=0` and persist it: "
                    f"`echo kernel.numa_balancing=0 | sudo tee /etc/sysctl.d/60-zerod.conf` ({HARDEN})")
    return PASS("kernel.numa_balancing = 0")


@check("numa.gpu_affinity", "Engine CPUs and memory on the GPU's NUMA node", "major")
def gpu_affinity(ctx: Ctx):
    pci = [d for d in ctx.fact("pci.nvidia", record=False) if d.get("kind") == "gpu"]
    if not pci:
        return SKIP("no NVIDIA GPU on the PCI bus")
    nodes = ctx.fact("numa.nodes")
    for d in pci:
        ctx.ev(f"{d['bdf']}.numa_node", d.get("numa_node"), f"/sys/bus/pci/devices/{d['bdf']}/numa_node")
    if len(nodes) <= 1:
        return PASS("one NUMA node: every CPU and all memory are local to the GPU")
    status = ctx.fact("self.status")
    cpus = set(parse_cpulist(status.get("Cpus_allowed_list")))
    mems = set(parse_cpulist(status.get("Mems_allowed_list")))
    fails, warns = [], []
    for d in pci:
        node = d.get("numa_node")
        if node is None or node < 0:
            warns.append(f"{d['bdf']} reports no NUMA node (numa_node = -1)")
            continue
        local = set(parse_cpulist(nodes.get(str(node))))
        if cpus and not (cpus & local):
            fails.append(f"{d['bdf']} is on node {node} (CPUs {nodes.get(str(node))}) but zerod may only "
                         f"run on CPUs {status.get('Cpus_allowed_list')}")
        if mems and node not in mems:
            fails.append(f"{d['bdf']} is on node {node} but zerod may only use memory of nodes "
                         f"{status.get('Mems_allowed_list')}")
    fix = ("let zerod's unit use the GPU's node: remove CPUAffinity=/AllowedCPUs=/NUMAMask= that "
           "exclude it (the daemon pins the engine to the node itself)")
    if fails:
        return FAIL("; ".join(fails), fix)
    if warns:
        return WARN("; ".join(warns) + ": the engine cannot be pinned to the GPU's node",
                    "enable NUMA (SRAT/ACPI) in the BIOS, or pin by hand with [daemon] settings")
    return PASS("the GPUs' nodes are within zerod's CPUs and memory; the daemon pins the engine there")


@check("mem.memlock", "Locked-memory limit unlimited or enough for pinned buffers", "major")
def memlock(ctx: Ctx):
    lim = ctx.fact("mem.memlock")
    soft, need = lim.get("soft"), ctx.cfg.memlock_min_bytes
    if soft is None:
        return PASS("memlock unlimited")
    if soft >= need:
        return PASS(f"memlock {_size(soft)} >= {_size(need)}")
    return WARN(f"memlock limited to {_size(soft)} (< {_size(need)}): pinned host buffers "
                "(the output ring, cudaHostRegister) fail or fall back to pageable copies",
                "for the service: LimitMEMLOCK=infinity in zerod.service (`sudo zerod harden --apply` "
                "writes the drop-in); for a shell: `* - memlock unlimited` in /etc/security/limits.d/")


@check("mem.transparent_hugepages", "Transparent hugepages not 'always'", "minor")
def transparent_hugepages(ctx: Ctx):
    thp = ctx.fact("mm.thp_enabled")
    defrag = ctx.optional("mm.thp_defrag")
    allowed = ctx.cfg.thp_allowed
    path = "/sys/kernel/mm/transparent_hugepage"
    if thp not in allowed:
        return WARN(f"transparent hugepages = {thp}: khugepaged compaction stalls the engine's threads "
                    "at random", f"`echo madvise | sudo tee {path}/enabled` ({HARDEN}, persistent)")
    if defrag == "always":
        return WARN("THP defrag = always: page faults wait for compaction",
                    f"`echo defer+madvise | sudo tee {path}/defrag` ({HARDEN})")
    return PASS(f"THP = {thp}" + (f", defrag = {defrag}" if defrag else ""))


@check("mem.swap", "No swap, or swappiness low enough to keep the engine in memory", "minor")
def swap(ctx: Ctx):
    sw = ctx.fact("mem.swap")
    total, used = sw["total_bytes"], sw["total_bytes"] - sw["free_bytes"]
    if not total:
        return PASS("no swap")
    ctx.optional("mem.swap_devices")
    swappiness = ctx.optional("vm.swappiness")
    most = MAX_SWAPPINESS
    on = f"swap on ({_size(total)}, {_size(used)} used)"
    if swappiness is None or swappiness > most:
        return WARN(f"{on} with vm.swappiness = {swappiness if swappiness is not None else '?'} (> {most}): "
                    "under memory pressure the kernel pages out the daemon's and the engine's host memory "
                    "(scheduler, tokenizer, Python heap), and each fault back on the decode path stalls a step",
                    "`sudo swapoff -a` and remove the swap lines of /etc/fstab; or keep swap for the rest of "
                    f"the host with `sudo sysctl -w vm.swappiness={min(most, 1)}` (persist it in "
                    "/etc/sysctl.d/) and MemorySwapMax=0 in a zerod.service drop-in")
    return PASS(f"{on}, vm.swappiness = {swappiness} (<= {most})")


@check("cpu.governor", "CPU frequency governor 'performance'", "minor")
def governor(ctx: Ctx):
    counts = ctx.fact("cpu.governors")
    want = ctx.cfg.cpu_governor
    other = {g: n for g, n in counts.items() if g != want}
    if other:
        return WARN(f"governor {', '.join(f'{g} on {n} CPU(s)' for g, n in other.items())}: the CPU "
                    "that launches kernels ramps up late, adding launch latency",
                    f"`echo {want} | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor` "
                    f"({HARDEN}, persistent)")
    return PASS(f"all {sum(counts.values())} CPUs on {want}")
