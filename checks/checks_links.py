"""Checks for tensor parallelism: the links between the engine's GPUs.

gpu.nvlink: every NVLink of the engine's GPUs up, and its error counters not
rising between two reads (checks/probe_links.py). Non-zero counters alone mean
nothing: a healthy H200 host showed 4-24 CRC-data errors per link.
gpu.p2p: NVML's P2P status for each pair of the engine's GPUs, what blocks it
on the PCIe path (an IOMMU translating DMA, ACS on the switches), and NCCL
variables in the engine's environment that turn peer-to-peer off.
Both skip with one GPU: nothing to talk to.
"""

from __future__ import annotations

from .checks_gpu import gpus
from .report import FAIL, PASS, SKIP, WARN, Ctx, check

# nvmlDeviceGetP2PStatus's answers (nvmlGpuP2PStatus_t)
P2P_STATUS = {0: "OK", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by the registry key", 5: "not supported", 6: "unknown"}
# nvmlDeviceGetTopologyCommonAncestor's answers (nvmlGpuTopologyLevel_t)
TOPOLOGY = {0: "the same board", 10: "one PCIe switch", 20: "several PCIe switches", 30: "one host bridge",
            40: "host bridges of one NUMA node", 50: "the CPU interconnect between NUMA nodes"}
NVSWITCH_FAR_END = "ffffffff:ff:ff.0"  # what NVML gives as the far end of a link to an NVSwitch
NVLINK_FIX = ("`nvidia-smi nvlink -s` and `nvidia-smi nvlink -e` show each link; a link down or erring after a "
              "GPU reset (`nvidia-smi -r`, no process on the GPU) or a reboot is a hardware fault: drain the host")
ACS_FIX = ("on the PCIe path: boot with `iommu=pt` (or turn the IOMMU off if nothing needs it), and turn PCIe ACS "
           "off on the switches between the GPUs (in the BIOS, or `setpci` on each bridge's ACS control); "
           "NVIDIA's NCCL troubleshooting guide lists both")


def _tp_gpus(ctx: Ctx) -> list[dict] | str:
    """The engine's GPUs, or why a link check has nothing to look at."""
    gl = gpus(ctx)
    if len(gl) < 2:
        return f"one GPU (GPU {gl[0].get('index')}): no peer to link to"
    return gl


@check("gpu.nvlink", "NVLinks up, error counters steady (tensor parallelism)", "major")
def nvlink(ctx: Ctx):
    gl = _tp_gpus(ctx)
    if isinstance(gl, str):
        return SKIP(gl)
    fact = ctx.optional("nvml.nvlink", None, record=False)
    if fact is None:
        return SKIP("NVLink state not read (fewer than 2 GPUs on this host, or NVML without NVLink calls)")
    mine = {g["index"] for g in gl}
    by_gpu = {g["index"]: g["links"] for g in fact["gpus"] if g["index"] in mine}
    ctx.ev("nvml.nvlink", {"read_gap_s": fact["read_gap_s"], "gpus": [{"index": i, "links": ls}
                                                                       for i, ls in by_gpu.items()]},
           ctx.facts.get("nvml.nvlink").source)
    if not any(by_gpu.values()):
        return SKIP(f"no NVLink on GPUs {', '.join(map(str, sorted(mine)))}: peers talk over PCIe (gpu.p2p)")
    down, rising, hard = [], [], False
    for idx, links in sorted(by_gpu.items()):
        off = [str(link["link"]) for link in links if link["state"] != 1]
        if off:
            down.append(f"GPU {idx}: link {', '.join(off)} down ({len(links) - len(off)} of {len(links)} up)")
        for link in links:
            grew = {k: (link["errors_again"].get(k) or 0) - (v or 0) for k, v in link["errors"].items()
                    if v is not None and link["errors_again"].get(k) is not None}
            grew = {k: d for k, d in grew.items() if d > 0}
            if grew:
                hard |= "recovery" in grew or "replay" in grew
                rising.append(f"GPU {idx} link {link['link']}: " + ", ".join(f"{k} +{d}" for k, d in grew.items()))
    gap = fact["read_gap_s"]
    if down:
        return FAIL("; ".join(down) + ": the all-reduce of tensor parallelism loses that bandwidth", NVLINK_FIX)
    if rising:
        msg = f"NVLink error counters rising within {gap:g} s: {'; '.join(rising)}"
        return FAIL(msg, NVLINK_FIX) if hard else WARN(msg, NVLINK_FIX)
    counts = sorted({len(ls) for ls in by_gpu.values()})
    switch = all(link.get("remote") == NVSWITCH_FAR_END for ls in by_gpu.values() for link in ls)
    crc = [sum(link["errors_again"].get("crc_data") or 0 for link in ls) for ls in by_gpu.values()]
    return PASS(f"GPUs {', '.join(map(str, sorted(by_gpu)))}: {'/'.join(map(str, counts))} NVLinks each, all up"
                + (" (far end: NVSwitch)" if switch else "")
                + f"; error counters steady over {gap:g} s (CRC-data totals {', '.join(map(str, crc))}: "
                  f"standing counts, not rising)")


# NCCL variables that turn peer-to-peer off, and when their value does
NCCL_P2P_OFF = {
    "NCCL_P2P_DISABLE": lambda v: v.strip() not in ("", "0"),
    "NCCL_P2P_LEVEL": lambda v: v.strip().upper() in ("LOC", "0"),
    "NCCL_NVLS_ENABLE": lambda v: v.strip() == "0",  # NVLink SHARP on NVSwitch systems
}


@check("gpu.p2p", "Peer-to-peer access between the engine's GPUs", "major")
def p2p(ctx: Ctx):
    gl = _tp_gpus(ctx)
    if isinstance(gl, str):
        return SKIP(gl)
    env = {**(ctx.optional("env.nccl", {}, record=False) or {}), **ctx.cfg.engine_env}
    off = [f"{k}={v}" for k, v in sorted(env.items()) if k in NCCL_P2P_OFF and NCCL_P2P_OFF[k](v)]
    if off:
        ctx.ev("engine environment", {k: env[k.split("=")[0]] for k in off}, "the environment, [daemon] engine_env")
    status = ctx.optional("nvml.p2p", None, record=False)
    if status is None:
        return SKIP("P2P status not read (fewer than 2 GPUs on this host)")
    mine = [g["index"] for g in gl]
    pairs = {k: v for k, v in status.items() if all(int(i) in mine for i in k.split("-"))}
    ctx.ev("nvml.p2p", pairs, ctx.facts.get("nvml.p2p").source)
    blocked = []
    for key, s in sorted(pairs.items()):
        bad = [f"{cap} {P2P_STATUS.get(s.get(cap), s.get(cap))}" for cap in ("read", "write") if s.get(cap) != 0]
        if bad:
            a, b = key.split("-")
            blocked.append(f"GPU {a} -> GPU {b}: {', '.join(bad)} (through {TOPOLOGY.get(s.get('topology'), '?')})")
    if blocked:
        iommu = ctx.optional("iommu", {}) or {}
        why = ""
        if iommu.get("units") and not any(w in ("iommu=pt", "iommu=off") for w in iommu.get("cmdline", [])):
            why = f"; an IOMMU translates DMA ({', '.join(iommu['units'])}, no iommu=pt on the kernel command line)"
        return FAIL("peer-to-peer blocked: " + "; ".join(blocked) + why
                    + "; NCCL copies through host memory, the all-reduce slows many times", ACS_FIX)
    if off:
        return FAIL(f"{', '.join(off)} in the engine's environment: NCCL will not use the peer-to-peer path "
                    f"NVML reports OK, and the all-reduce goes through host memory",
                    f"remove {', '.join(o.split('=')[0] for o in off)} from [daemon] engine_env or the unit's "
                    f"Environment=")
    nv = all(s.get("nvlink") == 0 for s in pairs.values())
    return PASS(f"peer access OK both ways between GPUs {', '.join(map(str, mine))}"
                + (" (over NVLink)" if nv else ""))
