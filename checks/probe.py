"""Run every probe into one facts snapshot. A probe that raises is recorded, not fatal."""

from __future__ import annotations

import datetime as _dt
import os
import time

from . import (probe_container, probe_diag, probe_disk, probe_links, probe_model, probe_net, probe_nvml,
               probe_procfs, probe_stuck, probe_sysfs, probe_torch)
from .config import DoctorConfig
from .facts import Facts, Roots, read_text
from .gpu_processes import scan_gpu_processes


def probe_facts(roots: Roots | dict | None = None, config: DoctorConfig | None = None) -> Facts:
    """Read the host (re-rooted by `roots`) into a Facts snapshot. Never raises for
    what it reads: each failure becomes an error fact that the checks report."""
    if isinstance(roots, dict):
        roots = Roots.make(**roots)
    roots = roots or Roots()
    cfg = config or DoctorConfig()
    facts = Facts(meta={"roots": {"procfs": roots.procfs, "sysfs": roots.sysfs, "rootfs": roots.rootfs},
                        "timings_ms": {}})
    try:
        hostname = read_text(roots.proc("sys/kernel/hostname")).strip()
    except OSError:
        hostname = os.uname().nodename
    facts.host = {"hostname": hostname,
                  "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

    def step(name: str, fn, *args) -> None:
        t = time.perf_counter()
        try:
            fn(facts, *args)
        except Exception as exc:  # noqa: BLE001 - a probe bug must not stop the others
            facts.fail(f"probe.{name}", f"{name} probe failed: {type(exc).__name__}: {exc}", name)
        facts.meta["timings_ms"][name] = round((time.perf_counter() - t) * 1000, 2)

    step("procfs", probe_procfs.probe, roots)
    step("sysfs", probe_sysfs.probe, roots)
    step("nvml", probe_nvml.probe)
    step("links", probe_links.probe, roots)  # NVLink, P2P, IOMMU, NCCL variables: what TP needs
    step("container", probe_container.probe, roots)  # after NVML: the GPUs are up when it opens them
    step("processes", _processes, roots)
    step("stuck", probe_stuck.probe, roots)
    step("fabric", _fabric_manager, roots)
    step("torch", probe_torch.probe)
    step("net", probe_net.probe)
    step("model", probe_model.probe, cfg.model, cfg.tokenizer)
    step("diag", probe_diag.probe, roots, cfg.state_dir)
    step("disk", probe_disk.probe, roots, cfg.model, cfg.state_dir)
    facts.host["kernel"] = facts.value("kernel.release")
    return facts


def _processes(facts: Facts, roots: Roots) -> None:
    stats: dict = {}
    t = time.perf_counter()
    procs = scan_gpu_processes(roots, nvml=facts.get("nvml").ok, stats=stats)
    stats["ms"] = round((time.perf_counter() - t) * 1000, 2)
    facts.put("gpu.processes", [p.to_dict() for p in procs],
              "NVML compute/graphics process lists + " + roots.proc("*/fd") + " scan")
    facts.put("gpu.process_scan", stats, roots.proc("*/fd"))
    facts.put("self.pids", [os.getpid()], "getpid()")


def _fabric_manager(facts: Facts, roots: Roots) -> None:
    """Only on NVSwitch systems: is nv-fabricmanager running?"""
    pci = facts.value("pci.nvidia") or []
    if not any(d.get("kind") == "nvswitch" for d in pci):
        return
    running = False
    for pid in (p for p in os.listdir(roots.procfs) if p.isdigit()):
        try:
            if read_text(roots.proc(f"{pid}/comm")).strip().startswith("nv-fabricmanage"):
                running = True
                break
        except OSError:
            continue
    facts.put("fabricmanager.running", running, roots.proc("*/comm"))
