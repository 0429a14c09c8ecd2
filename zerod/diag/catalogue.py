"""The tests `zerod diag` runs: stable IDs (docs/checks.md, "zerod diag"), what each
measures, at which level, and the fix when it fails."""

from __future__ import annotations

from typing import NamedTuple

LEVELS = ("quick", "full")


class DiagTest(NamedTuple):
    id: str
    title: str
    severity: str  # critical: the GPU computes wrong or not at all; major: it runs slow
    levels: tuple[str, ...]
    remediation: str


_DRAIN = ("drain the GPU, reset it (`sudo nvidia-smi -r -i GPU`) and run `zerod diag --level full` again; "
          "a GPU that fails again needs replacing (RMA)")
_SLOW = ("look at `zerod doctor` (gpu.clock_events, gpu.pcie_link) and at what else runs on the GPU "
         "(`nvidia-smi`); check cooling and power; run the test alone again")

TESTS: tuple[DiagTest, ...] = (
    DiagTest("diag.cuda_context", "CUDA context and a kernel launch", "critical", LEVELS,
             "check `zerod doctor` (gpu.driver_loaded, gpu.cuda_compat, gpu.compute_mode); " + _DRAIN),
    DiagTest("diag.hbm_bandwidth", "HBM bandwidth (device-to-device copy), checked byte for byte", "major",
             LEVELS, _SLOW + "; a copy that comes back wrong: " + _DRAIN),
    DiagTest("diag.gemm_bf16", "bf16 GEMM throughput, checked against an fp32 reference", "critical", LEVELS,
             "a wrong result: " + _DRAIN + "; slow: " + _SLOW),
    DiagTest("diag.gemm_fp8", "FP8 GEMM throughput, checked against an fp32 reference", "critical", LEVELS,
             "a wrong result: " + _DRAIN + "; slow: " + _SLOW),
    DiagTest("diag.pcie_h2d", "host-to-device bandwidth against the PCIe link's rate", "major", LEVELS,
             "reseat the card, check the slot, riser and BIOS slot setting (`nvidia-smi -q -d PCIE`); "
             "pin the test to the GPU's NUMA node"),
    DiagTest("diag.pcie_d2h", "device-to-host bandwidth against the PCIe link's rate", "major", LEVELS,
             "as for diag.pcie_h2d"),
    DiagTest("diag.p2p_bandwidth", "peer-to-peer bandwidth for each GPU pair with peer access", "major", LEVELS,
             "`nvidia-smi nvlink -s` and `nvidia-smi topo -m`; see doctor's gpu.nvlink and gpu.p2p"),
    DiagTest("diag.memory_pattern", "GPU memory written and read back with address patterns", "critical",
             ("full",), _DRAIN),
    DiagTest("diag.gemm_stress", "sustained bf16 GEMM, every result checked, clocks watched", "critical",
             ("full",), "wrong results: " + _DRAIN + "; slowing under load: cooling and power "
             "(`nvidia-smi -q -d PERFORMANCE`)"),
    DiagTest("diag.health_counters", "ECC, retired pages, row remaps, Xids and clock events before and after",
             "critical", LEVELS, "new uncorrectable errors or a pending remap: " + _DRAIN
             + "; HW slowdown during the tests: cooling and power"),
)
BY_ID = {t.id: t for t in TESTS}


def for_level(level: str) -> list[DiagTest]:
    return [t for t in TESTS if level in t.levels]
