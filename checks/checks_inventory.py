"""Checks on what the host should have and has room for: the GPU count it was
built with, free disk where zerod writes, no process stuck in the driver, and what
`zerod diag` last measured."""

from __future__ import annotations

import datetime as _dt

from .checks_gpu import gpus
from .report import FAIL, PASS, SKIP, WARN, Ctx, check

GIB = 1 << 30
DISK_FAIL_BYTES = 1 << 30  # below this the Triton cache and the state writes fail outright


@check("gpu.count", "The host shows the GPUs it was built with", "critical")
def gpu_count(ctx: Ctx):
    gpus(ctx)  # NVML unusable: fail, as every gpu.* check does
    want = ctx.cfg.expected_gpus
    if want is None:
        return SKIP("no expected count: set [doctor] expected_gpus to catch a GPU that fell off the bus")
    nvml = ctx.fact("nvml")
    seen = int(nvml.get("count") or 0)
    on_bus = [d for d in ctx.optional("pci.nvidia", []) or [] if d.get("kind") == "gpu"]
    ctx.ev("expected_gpus", want, "[doctor] expected_gpus")
    bus = f"; {len(on_bus)} on the PCI bus" if on_bus else ""
    if seen < want:
        return FAIL(f"NVML shows {seen} GPU(s), {want} expected{bus}",
                    "a GPU missing from NVML but on the bus failed to initialise (kernel log: Xid 79, RmInitAdapter "
                    "failed); missing from the bus too: reseat it or check its power, then reboot; "
                    "`nvidia-smi -L` lists what the driver sees")
    if seen > want:
        return WARN(f"NVML shows {seen} GPUs, {want} expected{bus}", "update [doctor] expected_gpus")
    return PASS(f"{seen} GPU(s), as expected")


@check("host.disk_space", "Room on disk for the model, the caches and the state", "major")
def disk_space(ctx: Ctx):
    rows = ctx.fact("disk.free")
    low, unreadable = [], []
    for r in rows:
        if "error" in r:
            unreadable.append(f"{r['what']} ({r['path']}): {r['error']}")
            continue
        if r["free_bytes"] < ctx.cfg.min_free_disk_bytes:
            low.append(r)
    floor = ctx.cfg.min_free_disk_bytes / GIB
    if low:
        msg = "; ".join(f"{r['what']} {r['path']}: {r['free_bytes'] / GIB:.1f} GiB free of "
                        f"{r['total_bytes'] / GIB:.0f} GiB" for r in low)
        fix = ("free space on that filesystem (old checkpoints, `huggingface-cli delete-cache`, "
               "`rm -rf ~/.triton/cache`) or point the cache elsewhere (HF_HOME, TRITON_CACHE_DIR, "
               "[daemon] state_dir)")
        if any(r["free_bytes"] < DISK_FAIL_BYTES for r in low):
            return FAIL(msg + f" (below 1 GiB: kernel-cache and state writes fail)", fix)
        return WARN(msg + f" (below [doctor] min_free_disk_bytes, {floor:.0f} GiB)", fix)
    if unreadable and len(unreadable) == len(rows):
        return SKIP("; ".join(unreadable))
    return PASS(", ".join(f"{r['what']} {r['free_bytes'] / GIB:.0f} GiB free" for r in rows if "error" not in r))


@check("gpu.stuck_processes", "No process stuck in the driver holding a GPU", "critical")
def stuck_processes(ctx: Ctx):
    gpus(ctx)
    doc = ctx.fact("gpu.stuck_processes")
    stuck = doc["stuck"]
    if stuck:
        names = "; ".join(f"{p['name']} (pid {p['pid']}, waiting in {p.get('wchan') or '?'}, holds "
                          f"{', '.join(p.get('devices') or [])})" for p in stuck)
        return FAIL(f"in uninterruptible sleep (state D) on two reads {doc['read_gap_s']} s apart: {names}",
                    "a process stuck inside the NVIDIA driver cannot be killed and keeps the GPU from a reset: "
                    "look for Xid/NVRM lines in `dmesg`; drain the host and reboot")
    return PASS(f"none of the {doc['holders']} process(es) holding /dev/nvidia* is stuck in state D")


def _age(started_at) -> str:
    if not isinstance(started_at, (int, float)):
        return ""
    s = _dt.datetime.now(_dt.timezone.utc).timestamp() - started_at
    return f", {s / 3600:.1f} h ago" if s >= 3600 else f", {max(s, 0) / 60:.0f} min ago"


@check("gpu.diag", "The last `zerod diag` found the GPUs healthy", "critical")
def diag_last(ctx: Ctx):
    now = {g.get("index"): g.get("uuid") for g in gpus(ctx)}
    last = ctx.fact("diag.last")
    # a board replaced since the run: its index now names another GPU, whose result that is not
    replaced = {g["index"] for g in last.get("gpus") or []
                if g.get("uuid") and g.get("index") in now and now[g["index"]] not in (None, g["uuid"])}
    tests = [t for t in last["tests"]
             if (ctx.cfg.gpus is None or t.get("gpu") is None or t["gpu"] in ctx.cfg.gpus)
             and t.get("gpu") not in replaced and t.get("peer") not in replaced]
    when = f"`zerod diag --level {last.get('level')}` ({last.get('time')}{_age(last.get('started_at'))})"
    if replaced and not tests:
        return SKIP(f"{when} ran on other boards (GPU {', '.join(map(str, sorted(replaced)))} has another "
                    f"UUID now): run `zerod diag` again")
    bad = [t for t in tests if t["status"] in ("fail", "warn", "error")]

    def where(t):
        return "" if t.get("gpu") is None else f" on GPU {t['gpu']}" + (
            f" -> {t['peer']}" if t.get("peer") is not None else "")

    text = "; ".join(f"{t['id']}{where(t)} {t['status']}: {t['message']}" for t in bad)
    fix = "`zerod diag` prints each test's fix; run `zerod diag --level full` on the GPU named"
    if any(t["status"] == "fail" for t in bad):
        return FAIL(f"{when}: {text}", fix)
    if bad:
        return WARN(f"{when}: {text}", fix)
    ran = sum(1 for t in tests if t["status"] == "pass")
    if not ran:
        return SKIP(f"{when} ran no test: " + (tests[0]["message"] if tests else "no test for these GPUs"))
    return PASS(f"{when}: {ran} test(s) passed")
