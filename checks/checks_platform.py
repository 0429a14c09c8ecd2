"""Checks on what the GPUs sit in: the IOMMU in front of them, the container around zerod."""

from __future__ import annotations

from .report import FAIL, PASS, SKIP, WARN, Ctx, check

GRUB_FIX = ("add `iommu=pt` to the kernel command line (Intel: `intel_iommu=on iommu=pt`; AMD: "
            "`iommu=pt`) in GRUB_CMDLINE_LINUX of /etc/default/grub, `sudo update-grub` (or "
            "`grub2-mkconfig -o /boot/grub2/grub.cfg`), and reboot")


@check("host.iommu", "IOMMU off or passthrough for the GPUs", "major")
def iommu(ctx: Ctx):
    info = ctx.fact("iommu")
    gpus = info.get("gpus") or {}
    if not gpus:
        return SKIP("no NVIDIA GPU on the PCI bus")
    if not info.get("units") and not any(g.get("group") for g in gpus.values()):
        return PASS("no IOMMU translates the GPUs' DMA (none enabled, or none exposed to this VM)")
    kinds: dict[str, list[str]] = {}
    for bdf, g in gpus.items():
        kinds.setdefault(g.get("type") or "unknown", []).append(bdf)
    translated = kinds.get("DMA", []) + kinds.get("DMA-FQ", [])
    if kinds.get("blocked"):
        return FAIL(f"the IOMMU blocks DMA for {', '.join(kinds['blocked'])}: the GPU cannot reach "
                    "host memory", GRUB_FIX)
    if kinds.get("unmanaged"):
        return WARN(f"{', '.join(kinds['unmanaged'])} sit(s) in a VFIO-owned IOMMU group (assigned to a "
                    "VM), not driven by this host", "unbind the GPU from vfio-pci (or run zerod in that VM)")
    if translated:
        if len(gpus) > 1:
            return WARN(f"the IOMMU translates DMA for {', '.join(translated)}: peer-to-peer copies "
                        "between GPUs and GPUDirect RDMA go through it (slower, or refused so that NCCL "
                        "falls back to copies through host memory)", GRUB_FIX)
        return PASS(f"one GPU behind a translating IOMMU ({translated[0]}): fine without peer-to-peer; "
                    "a multi-GPU host wants iommu=pt")
    if kinds.get("unknown"):
        cmdline = ctx.optional("kernel.cmdline", "") or ""
        if "iommu=pt" in cmdline.split() or any(o in cmdline.split() for o in
                                                 ("intel_iommu=off", "amd_iommu=off", "iommu=off")):
            return PASS("the kernel command line sets the IOMMU to passthrough or off")
        return SKIP("this kernel does not say the GPUs' IOMMU domain type "
                    "(/sys/kernel/iommu_groups/*/type, Linux 5.11+) and the command line sets no iommu=")
    return PASS(f"passthrough (identity domain) for {', '.join(kinds.get('identity', []))}")


RUNTIME_FIX = ("start the container with the NVIDIA runtime: install nvidia-container-toolkit on the host "
               "(`sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker`), "
               "then `docker run --gpus all …`; in Kubernetes set `runtimeClassName: nvidia` and a "
               "`nvidia.com/gpu` limit (deploy/kubernetes/daemonset.yaml)")


@check("host.container_runtime", "In a container: the NVIDIA runtime gave it the GPUs", "critical")
def container_runtime(ctx: Ctx):
    c = ctx.fact("container")
    if not c.get("in_container"):
        return SKIP("not in a container")
    rt = c.get("runtime") or "container"
    pci = ctx.optional("pci.nvidia", None, record=False)
    if pci is not None and not any(d.get("kind") == "gpu" for d in pci):
        return SKIP(f"in a {rt} container on a host with no NVIDIA GPU on the PCI bus: nothing to pass in")
    nv = ctx.fact("container.nvidia")
    nodes, opened = nv.get("device_nodes") or [], nv.get("open") or {}
    gpu_nodes = [n for n in nodes if n[len("/dev/nvidia"):].isdigit()]
    if not gpu_nodes or "/dev/nvidiactl" not in nodes:
        return FAIL(f"in a {rt} container without the NVIDIA device nodes (found: {', '.join(nodes) or 'none'}): "
                    "it was started without the NVIDIA runtime", RUNTIME_FIX)
    denied = [f"{n} ({why})" for n, why in opened.items() if why != "ok"]
    if denied:
        return FAIL(f"the device cgroup denies {', '.join(denied)}: the nodes are there but may not be opened",
                    "let the NVIDIA runtime add the nodes and their cgroup rules (`--gpus all`, or "
                    "`--device /dev/nvidiactl --device /dev/nvidia-uvm --device /dev/nvidia0`); in "
                    "Kubernetes request `nvidia.com/gpu` instead of mounting /dev by hostPath")
    status = ctx.optional("nvml.status", {}, record=False) or {}
    if not nv.get("libnvidia_ml") and status.get("kind") == "no_driver":
        return FAIL("the device nodes are there but libnvidia-ml.so.1 is not: the runtime injected no "
                    "driver libraries", "set NVIDIA_DRIVER_CAPABILITIES=compute,utility in the image "
                    "(deploy/container/Containerfile does) and use the NVIDIA runtime")
    env = c.get("nvidia_env") or {}
    how = (f"NVIDIA_VISIBLE_DEVICES={env['NVIDIA_VISIBLE_DEVICES']}" if "NVIDIA_VISIBLE_DEVICES" in env
           else "no NVIDIA_VISIBLE_DEVICES: the nodes were mounted by hand, not by the NVIDIA runtime")
    return PASS(f"in a {rt} container; {len(nodes)} NVIDIA device node(s) open read-write; {how}")
