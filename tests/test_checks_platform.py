"""The fleet checks (gpu.recovery_action, gpu.firmware, gpu.compute_mode, host.iommu,
host.container_runtime, mem.swap): the H200's values pass, a broken host's values warn or
fail with the fix, and the probes read fake /proc, /sys and / trees and a fake NVML
that lacks what old drivers lack - skipping with the reason, never crashing."""

from __future__ import annotations

import copy
import os
import types

import pynvml
import pytest

from test_checks_helpers import edit, edit_gpu0, load, result, statuses

from zerod.checks import Facts, Roots, run_checks
from zerod.checks import probe_container, probe_nvml, probe_procfs, probe_sysfs

GiB = 1 << 30
NEW = ("gpu.recovery_action", "gpu.firmware", "gpu.compute_mode", "host.iommu", "host.container_runtime",
       "mem.swap")


def fleet() -> Facts:
    return load("h200-fleet")


def two_gpus(f: Facts, **second) -> Facts:
    g = copy.deepcopy(f.value("nvml.gpus"))
    g.append({**copy.deepcopy(g[0]), "index": 1, "uuid": "GPU-2", "bus_id": "0000:00:07.0", **second})
    return edit(f, "nvml.gpus", g)


def iommu(*types_, units=("dmar0",)):
    return {"units": list(units), "groups": 40,
            "gpus": {f"0000:{i + 6:02x}:00.0": {"group": str(i + 20), "type": t} for i, t in enumerate(types_)}}


def in_container(nodes=("/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"), denied=(), libs=True, env=True):
    return lambda f: edit(edit(f, "container", {
        "in_container": True, "runtime": "docker", "evidence": ["/.dockerenv exists"],
        "nvidia_env": {"NVIDIA_VISIBLE_DEVICES": "all"} if env else {}}), "container.nvidia", {
        "device_nodes": list(nodes), "open": {n: "EPERM: Operation not permitted" if n in denied else "ok"
                                              for n in nodes},
        "libnvidia_ml": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"] if libs else []})


def foreign_context(f: Facts) -> Facts:
    job = {"pid": 733, "name": "python3", "cmdline": "python3 train.py", "gpus": [0], "source": "nvml",
           "gpu_memory_bytes": 16 * GiB, "devices": ["/dev/nvidia0"]}
    return edit(f, "gpu.processes", f.value("gpu.processes") + [job])


def corrupt_inforom(f: Facts) -> Facts:
    g = copy.deepcopy(f.value("nvml.gpus"))
    g[0]["errors"]["inforom_valid"] = "Corrupted infoROM"  # what nvmlDeviceValidateInforom raised
    return edit(f, "nvml.gpus", g)


# (check, how the host is broken, expected status, words the message must hold)
BROKEN = [
    ("gpu.recovery_action", lambda f: edit_gpu0(f, recovery_action=1), "fail", "needs a GPU reset"),
    ("gpu.recovery_action", lambda f: edit_gpu0(f, recovery_action=2), "fail", "node reboot"),
    ("gpu.recovery_action", lambda f: edit_gpu0(f, recovery_action=4), "warn", "drain and reset"),
    ("gpu.recovery_action", lambda f: edit_gpu0(f, recovery_action=42), "fail", "recovery action 42"),
    ("gpu.firmware", lambda f: edit_gpu0(f, gsp_firmware="570.86.15"), "fail", "GSP firmware 570.86.15 is not"),
    ("gpu.firmware", corrupt_inforom, "fail", "InfoROM is corrupted"),
    ("gpu.firmware", lambda f: two_gpus(f, vbios="96.00.99.00.01"), "warn", "different vbios versions"),
    ("gpu.compute_mode", lambda f: edit_gpu0(f, compute_mode=2), "fail", "Prohibited"),
    ("gpu.compute_mode", lambda f: foreign_context(edit_gpu0(f, compute_mode=3)), "fail",
     "the engine cannot create its own"),
    ("gpu.compute_mode", lambda f: edit_gpu0(f, compute_mode=1), "warn", "deprecated"),
    ("host.iommu", lambda f: edit(f, "iommu", iommu("DMA-FQ", "DMA-FQ")), "warn", "peer-to-peer"),
    ("host.iommu", lambda f: edit(f, "iommu", iommu("blocked")), "fail", "blocks DMA"),
    ("host.iommu", lambda f: edit(f, "iommu", iommu("unmanaged")), "warn", "VFIO"),
    ("host.container_runtime", in_container(nodes=()), "fail", "without the NVIDIA device nodes"),
    ("host.container_runtime", in_container(denied=("/dev/nvidia0",)), "fail", "device cgroup denies /dev/nvidia0"),
    ("mem.swap", lambda f: edit(f, "mem.swap", {"total_bytes": 8 * GiB, "free_bytes": 7 * GiB}), "warn",
     "vm.swappiness = 60"),
]


@pytest.mark.parametrize("cid,broken,status,words", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_check_on_broken_host(cid, broken, status, words):
    r = result(broken(fleet()), cid)
    assert (r.status, words in r.message) == (status, True), r.message
    assert r.remediation and r.evidence


def test_the_h200_values_pass():
    s = statuses(fleet())
    assert {c: s[c] for c in NEW} == {
        "gpu.recovery_action": "pass", "gpu.firmware": "pass", "gpu.compute_mode": "pass",
        "host.iommu": "skip", "host.container_runtime": "skip", "mem.swap": "pass"}  # the last two unrecorded
    r = result(fleet(), "gpu.firmware")
    assert r.message == "VBIOS 96.00.A5.00.1A, InfoROM G520.0282.02.02, GSP 580.159.04 = driver"
    r = result(fleet(), "gpu.compute_mode")
    assert "GPU 0 Default" in r.message and "--exclusive-gpu" in r.message
    assert run_checks(fleet()).exit_code == 0


def test_a_snapshot_without_the_new_facts_skips_saying_so():
    r = result(load("h200"), "gpu.compute_mode")
    assert r.status == "skip" and "older zerod" in r.message


def test_unsupported_by_the_driver_skips_with_nvml_s_reason():
    f = edit_gpu0(fleet(), recovery_action=None)  # errors: "Not Supported"
    r = result(f, "gpu.recovery_action")
    assert r.status == "skip" and "Not Supported" in r.message


def test_compute_mode_exclusive_passes_and_the_engine_s_own_context_is_no_obstacle():
    f = edit_gpu0(fleet(), compute_mode=3)
    assert result(f, "gpu.compute_mode").status == "pass"
    engine = {"pid": 900, "name": "python3", "cmdline": "python3 -m zerod serve --model /m", "gpus": [0],
              "source": "nvml", "gpu_memory_bytes": 120 * GiB}
    f = edit(f, "gpu.processes", f.value("gpu.processes") + [engine])
    assert result(f, "gpu.compute_mode").status == "pass"


def test_iommu_passthrough_single_gpu_and_none():
    f = fleet()
    assert result(edit(f, "iommu", iommu("identity")), "host.iommu").status == "pass"
    r = result(edit(f, "iommu", iommu("DMA")), "host.iommu")
    assert r.status == "pass" and "one GPU" in r.message
    r = result(edit(f, "iommu", iommu(units=())), "host.iommu")
    assert r.status == "skip"  # no GPU recorded in the facts
    r = result(edit(f, "iommu", {"units": [], "groups": 0, "gpus": {"0000:00:06.0": {"group": None, "type": None}}}),
               "host.iommu")
    assert r.status == "pass" and "no IOMMU" in r.message
    old_kernel = edit(edit(f, "iommu", iommu(None)), "kernel.cmdline", "ro iommu=pt quiet")
    assert result(old_kernel, "host.iommu").status == "pass"


def test_container_with_the_nvidia_runtime_passes():
    r = result(in_container()(fleet()), "host.container_runtime")
    assert r.status == "pass" and "NVIDIA_VISIBLE_DEVICES=all" in r.message
    r = result(in_container(env=False)(fleet()), "host.container_runtime")
    assert r.status == "pass" and "mounted by hand" in r.message
    nolib = edit(in_container(libs=False)(fleet()), "nvml.status", {"ok": False, "kind": "no_driver"})
    r = result(nolib, "host.container_runtime")
    assert r.status == "fail" and "libnvidia-ml.so.1 is not" in r.message


def test_swap_with_low_swappiness_passes():
    f = edit(edit(fleet(), "mem.swap", {"total_bytes": 8 * GiB, "free_bytes": 6 * GiB}), "vm.swappiness", 1)
    r = result(f, "mem.swap")
    assert r.status == "pass" and "8 GiB, 2 GiB used" in r.message


# -- probes -----------------------------------------------------------------------------------

def test_procfs_probe_reads_swap_swappiness_and_cmdline(tmp_path):
    proc = tmp_path / "proc"
    (proc / "sys" / "vm").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 131981020 kB\nSwapTotal:  8388604 kB\nSwapFree:  8000000 kB\n")
    (proc / "swaps").write_text("Filename\tType\tSize\tUsed\tPriority\n/swap.img file 8388604 388604 -2\n")
    (proc / "sys" / "vm" / "swappiness").write_text("60\n")
    (proc / "cmdline").write_text("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt\n")
    f = Facts()
    probe_procfs.probe(f, Roots.make(rootfs=str(tmp_path)))
    assert f.value("mem.swap") == {"total_bytes": 8388604 * 1024, "free_bytes": 8000000 * 1024}
    assert f.value("mem.swap_devices")[0]["used_bytes"] == 388604 * 1024
    assert f.value("vm.swappiness") == 60 and "iommu=pt" in f.value("kernel.cmdline")
    assert result(f, "mem.swap").status == "warn"


def test_sysfs_probe_reads_the_gpu_iommu_group(tmp_path):
    sys_ = tmp_path / "sys"
    dev = sys_ / "bus" / "pci" / "devices" / "0000:18:00.0"
    dev.mkdir(parents=True)
    for name, text in (("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", "0")):
        (dev / name).write_text(text + "\n")
    grp = sys_ / "kernel" / "iommu_groups" / "27"
    grp.mkdir(parents=True)
    (grp / "type").write_text("DMA-FQ\n")
    os.symlink("../../../kernel/iommu_groups/27", dev / "iommu_group")
    (sys_ / "class" / "iommu" / "dmar0").mkdir(parents=True)
    f = Facts()
    probe_sysfs.probe(f, Roots.make(rootfs=str(tmp_path)))
    assert f.value("iommu") == {"units": ["dmar0"], "groups": 1,
                                "gpus": {"0000:18:00.0": {"group": "27", "type": "DMA-FQ"}}}


def test_sysfs_probe_without_iommu(tmp_path):
    (tmp_path / "sys").mkdir()
    f = Facts()
    probe_sysfs.probe(f, Roots.make(rootfs=str(tmp_path)))
    assert f.value("iommu") == {"units": [], "groups": 0, "gpus": {}}


def test_container_probe_finds_the_runtime_and_opens_the_nodes(tmp_path):
    (tmp_path / ".dockerenv").write_text("")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "environ").write_bytes(b"PATH=/bin\0NVIDIA_VISIBLE_DEVICES=0\0"
                                                         b"KUBERNETES_SERVICE_HOST=10.0.0.1\0")
    (tmp_path / "dev").mkdir()
    for n in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia-uvm-tools", "null"):
        (tmp_path / "dev" / n).write_text("")
    os.symlink("/nonexistent/nvidia1", tmp_path / "dev" / "nvidia1")  # a node whose open fails
    lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").write_text("")
    f = Facts()
    probe_container.probe(f, Roots.make(rootfs=str(tmp_path)))
    c, nv = f.value("container"), f.value("container.nvidia")
    assert c["in_container"] and c["runtime"] == "kubernetes" and c["nvidia_env"] == {"NVIDIA_VISIBLE_DEVICES": "0"}
    assert nv["device_nodes"] == ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"]
    assert nv["open"]["/dev/nvidia0"] == "ok" and nv["open"]["/dev/nvidia1"].startswith("ENOENT")
    assert nv["libnvidia_ml"] == ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]


def test_container_probe_on_a_plain_host(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/system.slice/zerod.service\n")
    f = Facts()
    probe_container.probe(f, Roots.make(rootfs=str(tmp_path)))
    assert f.value("container")["in_container"] is False and "container.nvidia" not in f


class FakeNvml(types.SimpleNamespace):
    """pynvml's names over canned answers; a function set to an int raises that NVML error."""

    NVMLError = pynvml.NVMLError
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION

    def __getattribute__(self, name):
        v = object.__getattribute__(self, name)
        if name.startswith("nvmlDevice") and isinstance(v, int):
            def fail(*a, _code=v):
                raise pynvml.NVMLError(_code)
            return fail
        return v


def fake_nvml(**over):
    def field_values(h, ids):
        v = pynvml.c_nvmlFieldValue_t()
        v.fieldId, v.nvmlReturn, v.valueType = ids[0], 0, 1
        v.value.uiVal = 0
        return [v]

    base = dict(
        nvmlDeviceGetHandleByIndex=lambda i: "h", nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetComputeMode=lambda h: 0, nvmlDeviceGetFieldValues=field_values,
        nvmlDeviceGetVbiosVersion=lambda h: "96.00.A5.00.1A", nvmlDeviceGetInforomImageVersion=lambda h: "G520",
        nvmlDeviceValidateInforom=lambda h: None, nvmlDeviceGetGspFirmwareVersion=lambda h: "580.159.04",
        nvmlDeviceGetGspFirmwareMode=lambda h: [1, 1])
    return FakeNvml(**{**base, **over})


def test_nvml_probe_reads_the_new_fields():
    g = probe_nvml._gpu(fake_nvml(), 0)
    assert {k: g[k] for k in ("compute_mode", "recovery_action", "vbios", "inforom_image", "inforom_valid",
                              "gsp_firmware", "gsp_mode")} == {
        "compute_mode": 0, "recovery_action": 0, "vbios": "96.00.A5.00.1A", "inforom_image": "G520",
        "inforom_valid": True, "gsp_firmware": "580.159.04", "gsp_mode": [1, 1]}


def test_nvml_probe_on_an_old_driver_records_why_not():
    def not_supported(h, ids):
        v = pynvml.c_nvmlFieldValue_t()
        v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return [v]

    N = fake_nvml(nvmlDeviceGetComputeMode=pynvml.NVML_ERROR_NOT_SUPPORTED,
                  nvmlDeviceGetFieldValues=not_supported,
                  nvmlDeviceValidateInforom=pynvml.NVML_ERROR_CORRUPTED_INFOROM,
                  nvmlDeviceGetGspFirmwareVersion=pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    g = probe_nvml._gpu(N, 0)
    assert g["errors"]["compute_mode"] == "Not Supported" and g["errors"]["recovery_action"] == "Not Supported"
    assert g["errors"]["inforom_valid"] == "Corrupted infoROM" and "gsp_firmware" in g["errors"]
    N.__class__ = type("OldNvml", (FakeNvml,), {"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": None})  # before R550
    assert "no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" in probe_nvml._gpu(N, 0)["errors"]["recovery_action"]
