"""Probe /sys: NVIDIA PCI functions, transparent hugepages, cpufreq, NUMA nodes, the IOMMU."""

from __future__ import annotations

import os
import re

from .facts import Facts, Roots, read_into, read_text

NVIDIA_VENDOR = "0x10de"


def probe(facts: Facts, roots: Roots) -> None:
    _pci(facts, roots)
    read_into(facts, "mm.thp_enabled", roots.sys("kernel/mm/transparent_hugepage/enabled"), selected)
    read_into(facts, "mm.thp_defrag", roots.sys("kernel/mm/transparent_hugepage/defrag"), selected)
    _governors(facts, roots)
    _numa(facts, roots)
    _iommu(facts, roots)


def selected(s: str) -> str:
    """'always [madvise] never' -> 'madvise'."""
    m = re.search(r"\[(\S+)\]", s)
    return m.group(1) if m else s.strip()


def _read(path: str) -> str | None:
    try:
        return read_text(path, 4096).strip()
    except OSError:
        return None


def _pci(facts: Facts, roots: Roots) -> None:
    base = roots.sys("bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError as exc:
        facts.fail("pci.nvidia", f"cannot list {base}: {exc.strerror}", base,
                   missing=isinstance(exc, FileNotFoundError))
        return
    devs = []
    for name in names:
        d = os.path.join(base, name)
        if _read(os.path.join(d, "vendor")) != NVIDIA_VENDOR:
            continue
        cls = _read(os.path.join(d, "class")) or ""
        try:
            driver = os.path.basename(os.readlink(os.path.join(d, "driver")))
        except OSError:
            driver = None
        numa = _read(os.path.join(d, "numa_node"))
        devs.append({
            "bdf": name,
            "class": cls,
            # 0x03xxxx display/3D controller = GPU; 0x0680xx bridge = NVSwitch
            "kind": "gpu" if cls.startswith("0x03") else ("nvswitch" if cls.startswith("0x0680") else "other"),
            "device": _read(os.path.join(d, "device")),
            "driver": driver,
            "numa_node": int(numa) if numa and numa.lstrip("-").isdigit() else None,
            "local_cpulist": _read(os.path.join(d, "local_cpulist")),
            "current_link_speed": _read(os.path.join(d, "current_link_speed")),
            "max_link_speed": _read(os.path.join(d, "max_link_speed")),
            "current_link_width": _read(os.path.join(d, "current_link_width")),
            "max_link_width": _read(os.path.join(d, "max_link_width")),
        })
    facts.put("pci.nvidia", devs, base)


def _governors(facts: Facts, roots: Roots) -> None:
    base = roots.sys("devices/system/cpu")
    counts: dict[str, int] = {}
    try:
        cpus = [n for n in os.listdir(base) if re.fullmatch(r"cpu\d+", n)]
    except OSError as exc:
        facts.fail("cpu.governors", f"cannot list {base}: {exc.strerror}", base,
                   missing=isinstance(exc, FileNotFoundError))
        return
    for cpu in cpus:
        g = _read(os.path.join(base, cpu, "cpufreq/scaling_governor"))
        if g:
            counts[g] = counts.get(g, 0) + 1
    if not counts:
        facts.fail("cpu.governors", f"no cpufreq under {base}/cpu*/cpufreq (a VM, or frequency "
                   "under firmware control)", base, missing=True)
        return
    facts.put("cpu.governors", counts, f"{base}/cpu*/cpufreq/scaling_governor")


def _numa(facts: Facts, roots: Roots) -> None:
    base = roots.sys("devices/system/node")
    try:
        nodes = sorted(n for n in os.listdir(base) if re.fullmatch(r"node\d+", n))
    except OSError as exc:
        facts.fail("numa.nodes", f"cannot list {base}: {exc.strerror}", base,
                   missing=isinstance(exc, FileNotFoundError))
        return
    facts.put("numa.nodes", {n[4:]: _read(os.path.join(base, n, "cpulist")) or "" for n in nodes},
              f"{base}/node*/cpulist")


def _iommu(facts: Facts, roots: Roots) -> None:
    """IOMMU units (/sys/class/iommu: dmar*, ivhd*), and for each GPU its group and the
    group's DMA domain type (identity: passthrough; DMA, DMA-FQ: translated)."""
    units_dir, groups_dir = roots.sys("class/iommu"), roots.sys("kernel/iommu_groups")
    try:
        units = sorted(os.listdir(units_dir))
    except FileNotFoundError:
        units = []
    except OSError as exc:
        facts.fail("iommu", f"cannot list {units_dir}: {exc.strerror}", units_dir)
        return
    try:
        groups = len(os.listdir(groups_dir))
    except OSError:
        groups = 0
    gpus = {}
    for d in facts.value("pci.nvidia") or []:
        if d.get("kind") != "gpu":
            continue
        try:
            group = os.path.basename(os.readlink(roots.sys(f"bus/pci/devices/{d['bdf']}/iommu_group")))
        except OSError:
            group = None
        gpus[d["bdf"]] = {"group": group,
                          "type": _read(os.path.join(groups_dir, group, "type")) if group else None}
    facts.put("iommu", {"units": units, "groups": groups, "gpus": gpus},
              f"{units_dir}, {groups_dir}/*/type, /sys/bus/pci/devices/*/iommu_group")
