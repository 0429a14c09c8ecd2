"""GPU checks: driver, capability, CUDA, health, link, clocks, MIG, fabric, processes, memory, Xid."""

from __future__ import annotations

from typing import Any

from .clock_events import CLOCK_EVENTS
from .gpu_processes import (KNOWN_AGENTS, GpuProcess, classify, describe, foreign_severity, holds_context,
                            is_foreign, match_agent)
from .report import FAIL, PASS, SKIP, WARN, CheckFailed, Ctx, check
from .xid import describe as xid_describe

DRIVER_FIX = ("install the NVIDIA data-center driver (>= 525.60.13), e.g. "
              "`sudo apt install nvidia-driver-580-server-open` (or your distribution's "
              "nvidia-open package), then `sudo modprobe nvidia` or reboot; `nvidia-smi` must list the GPU")
MISMATCH_FIX = ("the running kernel module and the installed user-space driver differ (an upgrade "
                "without a reboot): reboot, or stop every GPU process and "
                "`sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia`")
NOUVEAU_FIX = ("blacklist nouveau and reboot: `printf 'blacklist nouveau\\noptions nouveau modeset=0\\n' "
               "| sudo tee /etc/modprobe.d/blacklist-nouveau.conf && sudo update-initramfs -u && sudo reboot`")

# NVML call behind each per-GPU field, for the evidence's source.
SOURCES = {
    "name": "nvmlDeviceGetName", "cc": "nvmlDeviceGetCudaComputeCapability",
    "memory": "nvmlDeviceGetMemoryInfo", "persistence": "nvmlDeviceGetPersistenceMode",
    "mig": "nvmlDeviceGetMigMode", "ecc": "nvmlDeviceGetEccMode",
    "pcie_gen": "nvmlDeviceGetCurrPcieLinkGeneration", "pcie_gen_max": "nvmlDeviceGetMaxPcieLinkGeneration",
    "pcie_width": "nvmlDeviceGetCurrPcieLinkWidth", "pcie_width_max": "nvmlDeviceGetMaxPcieLinkWidth",
    "pstate": "nvmlDeviceGetPerformanceState", "util": "nvmlDeviceGetUtilizationRates",
    "clock_events": "nvmlDeviceGetCurrentClocksEventReasons", "remapped_rows": "nvmlDeviceGetRemappedRows",
    "retired_pending": "nvmlDeviceGetRetiredPagesPendingStatus",
    "ecc_uncorrected_volatile": "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)",
    "fabric": "nvmlDeviceGetGpuFabricInfo", "compute_mode": "nvmlDeviceGetComputeMode",
    "recovery_action": "nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)",
    "vbios": "nvmlDeviceGetVbiosVersion", "inforom_image": "nvmlDeviceGetInforomImageVersion",
    "inforom_valid": "nvmlDeviceValidateInforom", "gsp_firmware": "nvmlDeviceGetGspFirmwareVersion",
    "gsp_mode": "nvmlDeviceGetGspFirmwareMode",
}
GiB = 1 << 30


def _nouveau(ctx: Ctx) -> str | None:
    mods = ctx.optional("kernel.modules", [], record=False) or []
    bound = [d["bdf"] for d in ctx.optional("pci.nvidia", [], record=False) or [] if d.get("driver") == "nouveau"]
    if "nouveau" in mods or bound:
        ctx.ev("nouveau", {"module_loaded": "nouveau" in mods, "bound_to": bound}, "/proc/modules, /sys/bus/pci")
        return f"nouveau is {'bound to ' + ', '.join(bound) if bound else 'loaded'}"
    return None


def no_driver(ctx: Ctx) -> CheckFailed:
    """Why NVML is unusable, as a failure with its fix."""
    status = ctx.optional("nvml.status", {}, record=False) or {}
    why = status.get("error") or ctx.facts.get("nvml").error or "NVML unavailable"
    kind = status.get("kind", "no_driver")
    ctx.ev("nvmlInit", None, "nvmlInit()", error=why)
    nv = _nouveau(ctx)
    if nv:
        return CheckFailed(f"no NVIDIA driver found: {nv}, so the NVIDIA driver cannot bind", NOUVEAU_FIX)
    if kind == "mismatch":
        mod = (ctx.optional("driver.proc_version", {}, record=False) or {}).get("version")
        return CheckFailed(why + (f" (kernel module {mod})" if mod else ""), MISMATCH_FIX)
    if kind == "no_pynvml":
        return CheckFailed(why, "`pip install nvidia-ml-py` into zerod's Python")
    if kind == "no_permission":
        return CheckFailed(why, "run as root or add the user to the group owning /dev/nvidia* "
                           "(ls -l /dev/nvidia*)")
    if kind == "no_driver":
        gpus = [d["bdf"] for d in ctx.optional("pci.nvidia", [], record=False) or [] if d.get("kind") == "gpu"]
        where = (f"; NVIDIA GPU(s) on the PCI bus at {', '.join(gpus)} have no driver" if gpus
                 else "; no NVIDIA GPU seen on the PCI bus either")
        return CheckFailed(why + where, DRIVER_FIX)
    return CheckFailed(why, DRIVER_FIX)


def gpus(ctx: Ctx) -> list[dict]:
    """The engine's GPUs from NVML; fails the check when NVML cannot be used."""
    if not ctx.facts.get("nvml").ok:
        exc = no_driver(ctx)  # the details are in gpu.driver_loaded; here the reason only
        raise CheckFailed(exc.message.split(":")[0] + " (see gpu.driver_loaded)", exc.fix)
    out = ctx.facts.value("nvml.gpus") or []
    if ctx.cfg.gpus is not None:
        out = [g for g in out if g.get("index") in ctx.cfg.gpus]
    if not out:
        raise CheckFailed("NVML found no GPU" + (f" among [doctor] gpus = {list(ctx.cfg.gpus)}"
                                                 if ctx.cfg.gpus is not None else ""), DRIVER_FIX)
    return out


def label(g: dict) -> str:
    return f"GPU {g.get('index')} ({g.get('name', '?')})"


def field(ctx: Ctx, g: dict, key: str, record: bool = True) -> Any:
    """A per-GPU NVML value, or None when NVML could not give it (recorded as such)."""
    if key in g:
        if record:
            ctx.ev(f"gpu{g['index']}.{key}", g[key], SOURCES.get(key, "NVML"))
        return g[key]
    err = (g.get("errors") or {}).get(key)
    if record and err:
        ctx.ev(f"gpu{g['index']}.{key}", None, SOURCES.get(key, "NVML"), error=err)
    return None


def version_tuple(v: str | None) -> tuple[int, ...]:
    out = []
    for part in str(v or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


@check("gpu.driver_loaded", "NVIDIA driver loaded (NVML starts)", "critical")
def driver_loaded(ctx: Ctx):
    nv = _nouveau(ctx)
    if not ctx.facts.get("nvml").ok:
        exc = no_driver(ctx)
        return FAIL(exc.message, exc.fix)
    system = ctx.fact("nvml")
    if nv:
        return FAIL(f"{nv} beside the NVIDIA driver", NOUVEAU_FIX)
    mod = (ctx.optional("driver.proc_version", {}) or {}).get("version")
    drv = system.get("driver_version")
    if mod and drv and mod != drv:
        return FAIL(f"driver/library version mismatch: kernel module {mod}, libnvidia-ml {drv}", MISMATCH_FIX)
    cuda = system.get("cuda_driver_version")
    cuda_s = f", CUDA {cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else ""
    return PASS(f"driver {drv}{cuda_s}, {system.get('count')} GPU(s)")


@check("gpu.compute_capability", "Compute capability >= 8.0", "critical")
def compute_capability(ctx: Ctx):
    need = ctx.cfg.min_compute_capability
    bad = []
    for g in gpus(ctx):
        cc = field(ctx, g, "cc")
        if cc is None:
            raise CheckFailed(f"{label(g)}: NVML did not report its compute capability", DRIVER_FIX)
        if cc[0] + cc[1] / 10 < need - 1e-9:
            bad.append(f"{label(g)} is sm_{cc[0]}{cc[1]} (compute capability {cc[0]}.{cc[1]})")
    if bad:
        return FAIL("; ".join(bad) + f": the engine needs {need:.1f}+ (sm_80: bf16 tensor cores, "
                    "FP8 paths, CUDA graphs with the full async allocator)",
                    "run zerod on Ampere or newer (A100, A10, L4, L40S, H100, H200); "
                    "leave older GPUs out with [doctor] gpus = [...] and CUDA_VISIBLE_DEVICES")
    return PASS(f"all GPUs >= {need:.1f}")


@check("gpu.driver_version", "NVIDIA driver >= 525.60.13", "critical")
def driver_version(ctx: Ctx):
    gpus(ctx)
    drv = ctx.fact("nvml").get("driver_version")
    need = ctx.cfg.min_driver_version
    if not drv:
        raise CheckFailed("NVML did not report the driver version", DRIVER_FIX)
    if version_tuple(drv) < version_tuple(need):
        return FAIL(f"driver {drv} is older than {need}", "upgrade the driver, e.g. "
                    "`sudo apt install nvidia-driver-580-server-open`, and reboot")
    return PASS(f"driver {drv} >= {need}")


@check("gpu.cuda_compat", "Driver's CUDA >= torch's CUDA runtime", "critical")
def cuda_compat(ctx: Ctx):
    gpus(ctx)
    cuda = ctx.fact("nvml").get("cuda_driver_version")
    if not isinstance(cuda, int):
        raise CheckFailed("NVML did not report the driver's CUDA version", DRIVER_FIX)
    drv = (cuda // 1000, cuda % 1000 // 10)
    t = ctx.facts.get("torch.install")
    if not t.ok:
        ctx.ev("torch.install", None, t.source, error=t.error)
        return FAIL(f"torch is not installed: {t.error}",
                    f"pip install torch (a CUDA {drv[0]}.x build: https://pytorch.org/get-started/locally/)")
    info = ctx.fact("torch.install")
    tc = info.get("cuda")
    if not tc:
        return FAIL(f"torch {info.get('version')} is a CPU-only build: the engine cannot use the GPU",
                    f"install a CUDA build of torch for CUDA <= {drv[0]}.{drv[1]}, e.g. "
                    f"`pip install torch --index-url https://download.pytorch.org/whl/cu{drv[0]}{drv[1]}`")
    need = version_tuple(tc)[:2]
    msg = f"driver supports CUDA {drv[0]}.{drv[1]}, torch {info.get('version')} needs CUDA {tc}"
    fix = (f"upgrade the driver to one that supports CUDA {tc}, or install torch built for CUDA "
           f"<= {drv[0]}.{drv[1]} (`pip install torch --index-url https://download.pytorch.org/whl/cu{drv[0]}{drv[1]}`)")
    if need[0] > drv[0]:
        return FAIL(msg, fix)
    if need > drv:
        return WARN(msg + " (minor-version compatibility: PTX JIT and some features fail)", fix)
    return PASS(msg)


@check("gpu.persistence_mode", "Persistence mode on", "major")
def persistence_mode(ctx: Ctx):
    off, unknown = [], 0
    for g in gpus(ctx):
        v = field(ctx, g, "persistence")
        if v is None:
            unknown += 1
        elif v != 1:
            off.append(label(g))
    if off:
        return WARN(f"persistence mode off on {', '.join(off)}: the driver tears the GPU down between "
                    "clients and the next start pays seconds of initialisation",
                    "`sudo systemctl enable --now nvidia-persistenced` (or `sudo nvidia-smi -pm 1`)")
    if unknown and unknown == len(gpus(ctx)):
        return SKIP("NVML does not report persistence mode here")
    return PASS("persistence mode on")


@check("gpu.ecc_health", "ECC on, no pending remaps or uncorrectable errors", "critical")
def ecc_health(ctx: Ctx):
    fails, warns = [], []
    for g in gpus(ctx):
        i, name = g["index"], label(g)
        ecc = field(ctx, g, "ecc")
        if ecc is not None and ecc[0] == 0:
            warns.append((f"{name}: ECC is off", f"`sudo nvidia-smi -i {i} -e 1` and reboot"))
        rows = field(ctx, g, "remapped_rows")
        if rows:
            if rows.get("failure"):
                fails.append((f"{name}: row remapping failed", "replace the GPU (RMA)"))
            elif rows.get("pending"):
                fails.append((f"{name}: a row remap is pending", f"drain the GPU, then `sudo nvidia-smi -r -i {i}` "
                              "(or reboot) to apply it"))
        if field(ctx, g, "retired_pending"):
            fails.append((f"{name}: retired pages are pending", f"drain the GPU, then `sudo nvidia-smi -r -i {i}` or reboot"))
        unc = field(ctx, g, "ecc_uncorrected_volatile")
        if unc:
            fails.append((f"{name}: {unc} uncorrectable ECC error(s) since the driver loaded",
                          f"drain the GPU, then `sudo nvidia-smi -r -i {i}`; replace it if they come back"))
    if fails:
        return FAIL("; ".join(m for m, _ in fails + warns), "; ".join(dict.fromkeys(f for _, f in fails + warns)))
    if warns:
        return WARN("; ".join(m for m, _ in warns), "; ".join(f for _, f in warns))
    return PASS("ECC on; no pending remaps, retired pages or uncorrectable errors")


def _sysfs_link(ctx: Ctx, g: dict) -> dict | None:
    for d in ctx.optional("pci.nvidia", [], record=False) or []:
        if d.get("bdf") == g.get("bus_id"):
            return d
    return None


@check("gpu.pcie_link", "PCIe link at full width and generation", "major")
def pcie_link(ctx: Ctx):
    fails, notes = [], []
    for g in gpus(ctx):
        name = label(g)
        w, wmax = field(ctx, g, "pcie_width"), field(ctx, g, "pcie_width_max")
        gen, gmax = field(ctx, g, "pcie_gen"), field(ctx, g, "pcie_gen_max")
        if None in (w, wmax, gen, gmax):
            d = _sysfs_link(ctx, g)  # NVML lacks it: sysfs has the same link
            if d:
                ctx.ev(f"{d['bdf']}.link", {k: d.get(k) for k in ("current_link_width", "max_link_width",
                       "current_link_speed", "max_link_speed")}, "/sys/bus/pci/devices/" + d["bdf"])
                try:
                    w, wmax = int(d["current_link_width"]), int(d["max_link_width"])
                except (TypeError, ValueError, KeyError):
                    pass
                if d.get("current_link_speed") and d.get("current_link_speed") == d.get("max_link_speed"):
                    gen = gmax = 0
            if None in (w, wmax):
                notes.append(f"{name}: link not reported")
                continue
        if w < wmax:
            fails.append(f"{name}: x{w} of x{wmax} lanes")
        if gen is not None and gmax is not None and gen < gmax:
            util = (field(ctx, g, "util") or {}).get("gpu", 0)
            pstate = field(ctx, g, "pstate")
            if util == 0:  # an idle link trains down to save power, even in P0
                notes.append(f"{name}: gen {gen} of {gmax} while idle (P{pstate}; the link trains down "
                             "when idle, up under load)")
            else:
                fails.append(f"{name}: gen {gen} of {gmax} while busy ({util}% util)")
    if fails:
        return FAIL("; ".join(fails) + " - host-to-GPU copies run slower",
                    "reseat the card and check the slot/riser wiring; in the BIOS set the slot to its "
                    "full generation; `nvidia-smi -q -d PCIE` shows the link")
    if notes and all("not reported" in n for n in notes):
        return SKIP("; ".join(notes))
    return PASS("; ".join(notes) if notes else "every link at full width and generation")


@check("gpu.clock_events", "No hardware slowdown, thermal or power-brake throttling", "major")
def clock_events(ctx: Ctx):
    fails, warns, unknown = [], [], 0
    for g in gpus(ctx):
        mask = field(ctx, g, "clock_events")
        if mask is None:
            unknown += 1
            continue
        for bit, (name, level) in CLOCK_EVENTS.items():
            if mask & bit and level == "fail":
                fails.append(f"{label(g)}: {name}")
            elif mask & bit and level == "warn":
                warns.append(f"{label(g)}: {name}")
    fix = ("check cooling (inlet temperature, fans, airflow), the PSU and power cabling; "
           "`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` shows which reason is active")
    if fails:
        return FAIL("active: " + "; ".join(fails + warns) + " - the GPU runs below its clocks", fix)
    if warns:
        return WARN("active: " + "; ".join(warns), fix)
    if unknown == len(gpus(ctx)):
        return SKIP("NVML does not report clock event reasons here")
    return PASS("no slowdown reason active")


@check("gpu.mig_mode", "MIG mode as expected (off: the engine wants whole GPUs)", "major")
def mig_mode(ctx: Ctx):
    on, pending, unsupported, idx = [], [], 0, []
    for g in gpus(ctx):
        mig = field(ctx, g, "mig")
        if mig is None:
            unsupported += 1
            continue
        if mig[0] or mig[0] != mig[1]:
            idx.append(str(g["index"]))
        if mig[0]:
            on.append(label(g))
        if mig[0] != mig[1]:
            pending.append(f"{label(g)} (pending {'on' if mig[1] else 'off'})")
    if on:
        return WARN(f"MIG is on for {', '.join(on)}: the engine sees one slice, not the whole GPU",
                    f"drain the GPU, then `sudo nvidia-smi -i {','.join(idx)} -mig 0` and reset it; "
                    "or waive gpu.mig_mode if slices are intended")
    if pending:
        return WARN(f"a MIG change waits for a GPU reset: {', '.join(pending)}",
                    f"drain the GPU and `sudo nvidia-smi -r -i {','.join(idx)}`")
    if unsupported:
        return PASS("MIG not supported on this GPU" if unsupported == 1 else "MIG not supported")
    return PASS("MIG off")


@check("gpu.fabric_manager", "Fabric Manager running (NVSwitch systems)", "critical")
def fabric_manager(ctx: Ctx):
    gl = gpus(ctx)
    switches = [d["bdf"] for d in ctx.fact("pci.nvidia", record=False) if d.get("kind") == "nvswitch"]
    if not switches:
        return SKIP("not an NVSwitch system (no NVSwitch on the PCI bus)")
    ctx.ev("nvswitches", switches, "/sys/bus/pci/devices/*/class")
    states = [field(ctx, g, "fabric") for g in gl]
    fix = ("`sudo systemctl enable --now nvidia-fabricmanager` (its version must equal the driver's); "
           "`journalctl -u nvidia-fabricmanager` says why it failed")
    if all(s is not None for s in states):
        bad = [label(g) for g, s in zip(gl, states) if s.get("state") != 3 or s.get("status") != 0]
        if bad:
            return FAIL(f"fabric not trained for {', '.join(bad)}: CUDA fails on these GPUs", fix)
        return PASS("fabric trained on every GPU")
    if not ctx.optional("fabricmanager.running", False):
        return FAIL("nv-fabricmanager is not running on an NVSwitch system: CUDA fails to start", fix)
    return PASS("nv-fabricmanager running")


def _own_pids(ctx: Ctx) -> list[int]:
    return ctx.optional("self.pids", [], record=False) or []


def classified(ctx: Ctx) -> list[tuple[GpuProcess, str, str]]:
    procs = [GpuProcess.from_dict(p) for p in ctx.fact("gpu.processes", record=False)]
    own = _own_pids(ctx)
    return [(p, *classify(p, own, ctx.cfg.allowed_gpu_processes)) for p in procs]


NVML_ONLY_EVIDENCE = ("an NVML-only agent polling at 10 Hz and at ~94 Hz left the engine's ITL unchanged "
                      "on the H200 (p50 5.32 ms, p99 6.3-6.6 ms); profiling counters such as DCGM's "
                      "can cost more")


@check("gpu.foreign_processes", "Nothing but zerod's engine holds the GPU", "critical")
def foreign_processes(ctx: Ctx):
    """Fail for a foreign CUDA context or GPU memory; warn for a process that only reads NVML."""
    gpus(ctx)
    found = classified(ctx)
    scan = ctx.optional("gpu.process_scan", {}, record=False) or {}
    nvml_lists = "nvml_error" not in scan
    src = ctx.facts.get("gpu.processes").source
    lines: dict[str, list[str]] = {"fail": [], "warn": []}
    fixes = []
    for p, role, why in found:
        level = foreign_severity(p, nvml_lists) if is_foreign(role) else None
        ctx.ev(f"pid {p.pid}", {"role": role, "why": why, "name": p.name, "source": p.source,
                                "gpu_memory_bytes": p.gpu_memory_bytes, "cuda_context": holds_context(p),
                                "severity": level, "unit": p.unit, "container": p.container,
                                "user": p.user, "cmdline": p.cmdline[:200]}, src)
        if level is None:
            continue
        agent = match_agent(p) if role == "agent" else None
        lines[level].append(f"- {describe(p)}" + (f" [{KNOWN_AGENTS[agent].description}]" if agent else ""))
        if agent:
            fixes.append(f"- pid {p.pid} ({agent}): {KNOWN_AGENTS[agent].fix}")
        else:
            stop = f"`sudo systemctl stop {p.unit}`" if p.unit else f"`sudo kill {p.pid}`"
            fixes.append(f"- pid {p.pid}: stop it ({stop}) or allow it: [doctor] "
                         f"allowed_gpu_processes = [\"{p.name}\"]")
    # one line per process: the text output shows them as a list
    readers = (f"{len(lines['warn'])} process(es) only read NVML (no CUDA context, no GPU memory):\n"
               + "\n".join(lines["warn"])) if lines["warn"] else ""
    if lines["fail"]:
        why = "" if nvml_lists else (f" (NVML's process lists could not be read: {scan['nvml_error']}; "
                                     "a holder the fd scan found may have a CUDA context)")
        return FAIL(f"{len(lines['fail'])} foreign process(es) with a CUDA context or GPU memory on the "
                    f"GPU{why}:\n" + "\n".join(lines["fail"]) + ("\n" + readers if readers else ""),
                    "\n".join(fixes))
    if readers:
        return WARN(f"{readers}\nharmless to latency at the rates measured: {NVML_ONLY_EVIDENCE}",
                    "\n".join(fixes))
    if scan.get("unreadable"):
        return WARN(f"could not read the fds of {scan['unreadable']} process(es): a process that only "
                    "polls NVML would be missed", "run `sudo zerod doctor` to see every process")
    mine = sum(1 for _, role, _ in found if role in ("self", "engine"))
    return PASS(f"no foreign process ({len(found)} holder(s): {mine} zerod, "
                f"{len(found) - mine} system/allowed)")


@check("gpu.memory_headroom", "Memory fraction <= 0.92 and enough free GPU memory", "critical")
def memory_headroom(ctx: Ctx):
    frac, cap = ctx.cfg.gpu_memory_utilization, ctx.cfg.max_memory_fraction
    ctx.ev("gpu_memory_utilization", frac, "[engine]/[doctor] gpu_memory_utilization")
    gl = gpus(ctx)
    if frac > cap + 1e-9:
        return FAIL(f"gpu_memory_utilization {frac} is above {cap}: the CUDA context, cuBLAS workspaces "
                    "and graphs need the rest, so the engine would run out of memory",
                    f"set [engine] gpu_memory_utilization = {cap} or lower")
    # Memory held by zerod itself (a running engine) is the engine's own: count it as free.
    own = {}
    try:
        for p, role, _ in classified(ctx):
            if role in ("self", "engine") and p.gpu_memory_bytes:
                for i in p.gpus:
                    own[i] = own.get(i, 0) + p.gpu_memory_bytes // max(1, len(p.gpus))
    except Exception:  # noqa: BLE001 - without the process list, judge by free memory alone
        pass
    short = []
    for g in gl:
        mem = field(ctx, g, "memory")
        if not mem:
            continue
        want = frac * mem["total"]
        free = mem["free"] + own.get(g["index"], 0)
        if free < want:
            short.append(f"{label(g)}: {free / GiB:.1f} GiB free, the engine wants {frac} x "
                         f"{mem['total'] / GiB:.1f} = {want / GiB:.1f} GiB")
    if short:
        return FAIL("; ".join(short), "stop what holds GPU memory (see gpu.foreign_processes) or lower "
                    "[engine] gpu_memory_utilization")
    return PASS(f"fraction {frac} <= {cap}; enough free memory on every GPU")


@check("gpu.xid_recent", "No critical Xid error in the kernel log window", "critical")
def xid_recent(ctx: Ctx):
    gpus(ctx)
    data = ctx.fact("kernel.xid_events", record=False)
    up, window = data.get("uptime_s"), ctx.cfg.xid_window_s
    recent = [e for e in data.get("events", [])
              if e.get("t_s") is None or up is None or up - e["t_s"] <= window]
    ctx.ev("kernel.xid_events", recent, ctx.facts.get("kernel.xid_events").source)
    crit = [e for e in recent if xid_describe(e["xid"]).critical]
    soft = [e for e in recent if not xid_describe(e["xid"]).critical]

    def say(es):
        return "; ".join(dict.fromkeys(f"Xid {e['xid']} on {e['pci']} ({xid_describe(e['xid']).meaning})" for e in es))

    fix = "; ".join(dict.fromkeys(f"Xid {e['xid']}: {xid_describe(e['xid']).action}" for e in crit + soft))
    if crit:
        return FAIL(f"in the last {window} s: {say(crit)}", fix)
    if soft:
        return WARN(f"in the last {window} s: {say(soft)}", fix)
    return PASS(f"no Xid in the last {window} s")
