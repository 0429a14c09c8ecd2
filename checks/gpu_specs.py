"""What each data-center GPU model is built to do: the figures `zerod diag`
measures against (HBM bandwidth, dense bf16 and FP8 tensor throughput, NVLink per
link), keyed by the name NVML reports, and the PCIe rate of a link.

Figures are the vendor's datasheet values without sparsity. A GPU not in the table
gets no expected figure: its tests still check correctness and report what they
measured.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class GpuSpec(NamedTuple):
    model: str
    hbm_gb_s: float            # memory bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float         # dense bf16 tensor throughput, TFLOP/s
    fp8_tflops: float | None   # dense FP8 tensor throughput; None: no FP8 tensor cores
    nvlink_gb_s_per_link: float | None  # one direction, one link; None: no NVLink


# (pattern matched against the NVML name, case-insensitive; first match wins) -> spec.
# Longer, more specific names come first (H100 PCIe before H100).
SPECS: tuple[tuple[str, GpuSpec], ...] = (
    (r"GH200", GpuSpec("GH200", 4000, 989, 1979, 25)),
    (r"H200 NVL", GpuSpec("H200 NVL", 4800, 835, 1671, 25)),
    (r"H200", GpuSpec("H200 SXM", 4800, 989, 1979, 25)),
    (r"H100 NVL", GpuSpec("H100 NVL", 3900, 835, 1671, 25)),
    (r"H100 PCIe", GpuSpec("H100 PCIe", 2000, 756, 1513, 25)),
    (r"H100", GpuSpec("H100 SXM", 3350, 989, 1979, 25)),
    (r"H800", GpuSpec("H800 SXM", 3350, 989, 1979, 25)),
    (r"B200", GpuSpec("B200", 8000, 2250, 4500, 50)),
    (r"A100.*80GB PCIe", GpuSpec("A100 80GB PCIe", 1935, 312, None, 25)),
    (r"A100-PCIE-40GB", GpuSpec("A100 40GB PCIe", 1555, 312, None, 25)),
    (r"A100-SXM4-80GB", GpuSpec("A100 80GB SXM", 2039, 312, None, 25)),
    (r"A100", GpuSpec("A100 40GB SXM", 1555, 312, None, 25)),
    (r"A800", GpuSpec("A800", 2039, 312, None, 25)),
    (r"L40S", GpuSpec("L40S", 864, 362, 733, None)),
    (r"L40", GpuSpec("L40", 864, 181, 362, None)),
    (r"\bL4\b", GpuSpec("L4", 300, 121, 242, None)),
    (r"A10\b", GpuSpec("A10", 600, 125, None, None)),
)

# One lane, one direction, after line coding (GB/s): 8b/10b up to gen 2, 128b/130b from gen 3.
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def spec_for(name: str | None) -> GpuSpec | None:
    """The spec of the GPU NVML calls `name` ("NVIDIA H200"), or None when unknown."""
    for pattern, spec in SPECS:
        if name and re.search(pattern, name, re.IGNORECASE):
            return spec
    return None


def pcie_gb_s(generation: int | None, width: int | None) -> float | None:
    """One direction of a PCIe link of this generation and width, in GB/s."""
    if not generation or not width or generation not in PCIE_LANE_GB_S:
        return None
    return PCIE_LANE_GB_S[generation] * width
