"""GPU checks on what the driver reports about the board: a pending recovery action, the
firmware versions, the compute mode."""

from __future__ import annotations

from . import compute_mode as cm
from .checks_gpu import classified, field, gpus, label
from .gpu_processes import holds_context
from .report import FAIL, PASS, SKIP, WARN, Ctx, check


def _unreported(ctx: Ctx, gl: list[dict], key: str) -> str:
    """Why no GPU reported `key`: NVML's error, or a snapshot taken before zerod probed it."""
    errs = {(g.get("errors") or {}).get(key) for g in gl} - {None}
    return "; ".join(sorted(errs)) if errs else "not in this snapshot (taken by an older zerod)"


# nvmlDeviceGpuRecoveryAction_t -> (name, status while pending, what to do on GPU {i})
RECOVERY = {
    1: ("GPU reset", "fail", "stop the engine (`sudo systemctl stop zerod`), then `sudo nvidia-smi -r -i {i}`"),
    2: ("node reboot", "fail", "drain the node and reboot it"),
    3: ("drain peer-to-peer traffic", "fail", "stop the jobs that use NVLink/P2P with this GPU, then "
        "`sudo nvidia-smi -r -i {i}`"),
    4: ("drain and reset", "warn", "the GPU still works, degraded: drain it at the next window "
        "(`sudo systemctl stop zerod`) and `sudo nvidia-smi -r -i {i}`"),
    5: ("recover the IMEX domain", "fail", "restart the IMEX daemon (`sudo systemctl restart nvidia-imex`) "
        "on every node of the NVLink domain"),
    6: ("PCIe bus reset", "fail", "stop the engine, then `sudo nvidia-smi -r -i {i}` (or reboot)"),
    7: ("system reboot", "fail", "drain the node and reboot it (a full power cycle if it persists)"),
}


@check("gpu.recovery_action", "No GPU waits for a reset, drain or reboot", "critical")
def recovery_action(ctx: Ctx):
    gl = gpus(ctx)
    found, unknown = [], 0
    for g in gl:
        v = field(ctx, g, "recovery_action")
        if v is None:
            unknown += 1
        elif v:
            what, level, fix = RECOVERY.get(v, (f"recovery action {v}", "fail", "see `nvidia-smi -q`; "
                                                 "drain the GPU and reset it"))
            found.append((level, f"{label(g)} needs a {what}", fix.format(i=g["index"])))
    if found:
        msg = "; ".join(m for _, m, _ in found) + ": the driver says the GPU cannot serve as it is"
        fix = "; ".join(dict.fromkeys(f for _, _, f in found))
        return FAIL(msg, fix) if any(lv == "fail" for lv, _, _ in found) else WARN(msg, fix)
    if unknown == len(gl):
        return SKIP(f"the driver does not report a recovery action: {_unreported(ctx, gl, 'recovery_action')}")
    return PASS("no recovery action pending")


@check("gpu.firmware", "VBIOS, InfoROM and GSP firmware consistent with the driver", "major")
def firmware(ctx: Ctx):
    gl = gpus(ctx)
    drv = (ctx.optional("nvml", {}, record=False) or {}).get("driver_version")
    ctx.ev("driver_version", drv, "nvmlSystemGetDriverVersion")
    fails, warns, seen = [], [], 0
    fw_fix = ("reinstall the driver package so that its GSP firmware (/lib/firmware/nvidia/<version>/) "
              "matches it, then reboot")
    for g in gl:
        vbios, image = field(ctx, g, "vbios"), field(ctx, g, "inforom_image")
        gsp, gsp_mode = field(ctx, g, "gsp_firmware"), field(ctx, g, "gsp_mode")
        valid = field(ctx, g, "inforom_valid", record=False)
        err = (g.get("errors") or {}).get("inforom_valid") or ""
        ctx.ev(f"gpu{g['index']}.inforom_valid", valid, "nvmlDeviceValidateInforom", error=err or None)
        seen += any(v is not None for v in (vbios, image, gsp))
        if "corrupt" in err.lower():
            fails.append((f"{label(g)}: the InfoROM is corrupted ({err}): ECC and page-retirement "
                          "records may be lost", "have the board's InfoROM reflashed by the vendor or RMA it"))
        gsp_on = gsp_mode is None or gsp_mode[0] == 1
        if gsp and drv and gsp_on and gsp not in ("N/A", drv):
            fails.append((f"{label(g)}: GSP firmware {gsp} is not the driver's {drv}", fw_fix))
    # Identical boards should run identical firmware: a mix is a fleet half updated.
    by_model: dict[tuple, dict[str, set]] = {}
    for g in gl:
        for key in ("vbios", "inforom_image"):
            if g.get(key):
                by_model.setdefault((g.get("name"),), {}).setdefault(key, set()).add(g[key])
    for (model,), versions in by_model.items():
        for key, vs in versions.items():
            if len(vs) > 1:
                warns.append((f"{model} boards run different {key.replace('_', ' ')} versions: "
                               f"{', '.join(sorted(vs))}", "update every board to the same version with the "
                               "vendor's firmware tool (nvflash or the OEM's bundle)"))
    if not seen and not fails:
        return SKIP(f"the driver reports no firmware versions: {_unreported(ctx, gl, 'vbios')}")
    problems = fails + warns
    fix = "; ".join(dict.fromkeys(f for _, f in problems))
    if fails:
        return FAIL("; ".join(m for m, _ in problems), fix)
    if warns:
        return WARN("; ".join(m for m, _ in warns), fix)
    g = gl[0]
    gsp = g.get("gsp_firmware")
    return PASS(f"VBIOS {g.get('vbios', '?')}, InfoROM {g.get('inforom_image', '?')}, "
                + (f"GSP {gsp} = driver" if gsp and gsp != "N/A" else "no GSP firmware")
                + (f" (all {len(gl)} GPUs alike)" if len(gl) > 1 else ""))


HARDEN_EXCLUSIVE = "`sudo zerod harden --apply --exclusive-gpu`"


@check("gpu.compute_mode", "Compute mode lets the engine create its context", "critical")
def compute_mode(ctx: Ctx):
    gl = gpus(ctx)
    modes = {g["index"]: field(ctx, g, "compute_mode") for g in gl}
    if all(m is None for m in modes.values()):
        return SKIP(f"the driver does not report the compute mode: {_unreported(ctx, gl, 'compute_mode')}")
    names = ", ".join(f"GPU {i} {cm.name(m)}" for i, m in modes.items() if m is not None)
    prohibited = [i for i, m in modes.items() if m == cm.PROHIBITED]
    if prohibited:
        ids = ",".join(map(str, prohibited))
        return FAIL(f"{names}: no process may create a CUDA context on GPU {ids}, the engine neither",
                    f"`sudo nvidia-smi -i {ids} -c EXCLUSIVE_PROCESS` (or DEFAULT)")
    # In EXCLUSIVE_PROCESS a foreign context already on the GPU keeps the engine out.
    exclusive = {i for i, m in modes.items() if m in (cm.EXCLUSIVE_PROCESS, cm.EXCLUSIVE_THREAD)}
    try:
        holders = [p for p, role, _ in classified(ctx)
                   if role not in ("self", "engine") and holds_context(p) and exclusive & set(p.gpus)]
    except Exception:  # noqa: BLE001 - no process list: judge the mode alone
        holders = []
    if holders:
        who = ", ".join(f"pid {p.pid} {p.name} (GPU {','.join(map(str, p.gpus))})" for p in holders)
        return FAIL(f"{names}, and {who} holds a CUDA context there: the engine cannot create its own",
                    "stop that process (see gpu.foreign_processes) before starting the engine")
    if any(m == cm.EXCLUSIVE_THREAD for m in modes.values()):
        return WARN(f"{names}: EXCLUSIVE_THREAD is deprecated (the driver treats it as EXCLUSIVE_PROCESS)",
                    f"set EXCLUSIVE_PROCESS by name: {HARDEN_EXCLUSIVE}")
    if exclusive:
        return PASS(f"{names}: only one process may create a CUDA context; NVML readers still work")
    return PASS(f"{names}: any process may create a CUDA context beside the engine; "
                f"{HARDEN_EXCLUSIVE} or [daemon] exclusive_gpu = true keeps them out")
