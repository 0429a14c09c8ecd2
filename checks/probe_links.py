"""Probe what tensor parallelism needs between GPUs: each GPU's NVLinks (state,
far end, error counters read twice), NVML's P2P status for each pair, the
IOMMU, and the NCCL variables of this environment.

The error counters are read twice, `READ_GAP_S` apart: a healthy H200 host
already shows non-zero CRC-data counts (7-24 per link on the 2-GPU machine),
so what matters is whether they rise (gpu.nvlink). Only on hosts of two GPUs
or more: one GPU has no peer.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .facts import Facts, Roots
from .pci import normalize_bdf

READ_GAP_S = 0.5
MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
# nvmlDeviceGetNvLinkErrorCounter's counters (NVML_NVLINK_ERROR_DL_*)
ERROR_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
# nvmlDeviceGetP2PStatus's capabilities (NVML_P2P_CAPS_INDEX_*)
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
NCCL_VARS = ("NCCL_", "CUDA_VISIBLE_DEVICES")


def probe(facts: Facts, roots: Roots) -> None:
    from .probe_nvml import NvmlUnavailable, session

    try:
        N = session()
    except NvmlUnavailable:
        return  # gpu.driver_loaded says why
    count = N.nvmlDeviceGetCount()
    facts.put("env.nccl", {k: v for k, v in os.environ.items() if k.startswith(NCCL_VARS)}, "the environment")
    _iommu(facts, roots)
    if count < 2:
        return
    handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    links = [_links(N, h) for h in handles]
    time.sleep(READ_GAP_S)
    for gpu_links, h in zip(links, handles):
        for link in gpu_links:
            link["errors_again"] = _errors(N, h, link["link"])
    facts.put("nvml.nvlink", {"read_gap_s": READ_GAP_S,
                              "gpus": [{"index": i, "links": ls} for i, ls in enumerate(links)]},
              f"nvmlDeviceGetNvLinkState/RemotePciInfo/ErrorCounter (counters read twice, {READ_GAP_S} s apart)")
    facts.put("nvml.p2p", _p2p(N, handles), "nvmlDeviceGetP2PStatus, nvmlDeviceGetTopologyCommonAncestor")


def _links(N, h) -> list[dict[str, Any]]:
    out = []
    for link in range(MAX_LINKS):
        try:
            state = int(N.nvmlDeviceGetNvLinkState(h, link))
        except N.NVMLError:
            break  # no such link (or no NVLink at all)
        entry: dict[str, Any] = {"link": link, "state": state}
        try:
            entry["remote"] = normalize_bdf(_s(N.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
        except N.NVMLError:
            entry["remote"] = None
        entry["errors"] = _errors(N, h, link)
        out.append(entry)
    return out


def _errors(N, h, link: int) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, counter in ERROR_COUNTERS.items():
        try:
            out[name] = int(N.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
        except N.NVMLError:
            out[name] = None
    return out


def _p2p(N, handles) -> dict[str, dict[str, Any]]:
    out = {}
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i == j:
                continue
            pair: dict[str, Any] = {}
            for name, cap in P2P_CAPS.items():
                try:
                    pair[name] = int(N.nvmlDeviceGetP2PStatus(a, b, cap))
                except N.NVMLError:
                    pair[name] = None
            try:
                pair["topology"] = int(N.nvmlDeviceGetTopologyCommonAncestor(a, b))
            except N.NVMLError:
                pair["topology"] = None
            out[f"{i}-{j}"] = pair
    return out


def _iommu(facts: Facts, roots: Roots) -> None:
    """Is an IOMMU translating DMA (it can block or slow PCIe peer-to-peer)?"""
    try:
        units = sorted(os.listdir(roots.sys("class/iommu")))
    except OSError:
        units = []
    try:
        cmdline = open(roots.proc("cmdline")).read().split()
    except OSError:
        cmdline = []
    facts.put("iommu", {"units": units, "cmdline": [w for w in cmdline if w.startswith(("iommu", "intel_iommu",
                                                                                          "amd_iommu"))]},
              roots.sys("class/iommu") + ", " + roots.proc("cmdline"))


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
