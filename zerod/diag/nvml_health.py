"""The counters a sick GPU moves, read before the tests and after: uncorrectable
ECC errors, row remaps, retired pages waiting for a reset, clock event reasons
(NVML, through doctor's own probe), and NVIDIA Xid lines in the kernel log.

A counter that rises while the tests run fails `diag.health_counters`; a HW
slowdown seen after the tests warns (it explains a slow figure)."""

from __future__ import annotations

from typing import Any

from zerod.checks.clock_events import CLOCK_EVENTS, reasons_from_mask
from zerod.checks.facts import Facts, Roots
from zerod.checks.pci import normalize_bdf
from zerod.checks.probe_nvml import probe as probe_nvml
from zerod.checks.probe_procfs import probe_xids
from zerod.checks.xid import describe as describe_xid

# the reasons doctor's gpu.clock_events judges (the GPU runs below its clocks)
SLOWDOWN_REASONS = tuple(e.name for e in CLOCK_EVENTS.values() if e.level is not None)
HW_SLOWDOWN_REASONS = tuple(e.name for e in CLOCK_EVENTS.values() if e.level == "fail")


def read_nvml() -> Facts:
    """NVML's view of every GPU (doctor's probe: no CUDA context)."""
    facts = Facts()
    probe_nvml(facts)
    return facts


def snapshot(facts: Facts | None = None, roots: Roots | None = None) -> dict[str, Any]:
    """{"gpus": {index: counters}, "xids": [...], "xid_error": why or None}."""
    facts = facts or read_nvml()
    probe_xids(facts, roots or Roots())
    gpus: dict[int, dict[str, Any]] = {}
    for g in facts.value("nvml.gpus") or []:
        mask = g.get("clock_events")
        gpus[g["index"]] = {
            "bus_id": g.get("bus_id"),
            "ecc_uncorrected_volatile": g.get("ecc_uncorrected_volatile"),
            "remapped_rows": g.get("remapped_rows"),
            "retired_pending": g.get("retired_pending"),
            "clock_events": reasons_from_mask(int(mask)) if mask is not None else None,
        }
    xf = facts.get("kernel.xid_events")
    return {"gpus": gpus, "xids": (xf.value or {}).get("events", []) if xf.ok else [],
            "xid_error": None if xf.ok else xf.error}


def _new_xids(before: dict[str, Any], after: dict[str, Any], bus_id: str | None) -> list[dict]:
    seen = {(x.get("t_s"), x.get("xid"), x.get("pci")) for x in before["xids"]}
    out = []
    for x in after["xids"]:
        if (x.get("t_s"), x.get("xid"), x.get("pci")) in seen:
            continue
        # the kernel names the device without its function ('0000:19:00'), NVML with it
        if bus_id and x.get("pci") and not normalize_bdf(bus_id).startswith(normalize_bdf(x["pci"])):
            continue
        out.append(x)
    return out


def judge(gpu: int, before: dict[str, Any], after: dict[str, Any]) -> tuple[str, str, list[dict]]:
    """(status, message, evidence) for one GPU's counters over the run."""
    b, a = before["gpus"].get(gpu), after["gpus"].get(gpu)
    evidence = [{"name": "before", "value": b, "source": "NVML"}, {"name": "after", "value": a, "source": "NVML"}]
    if a is None or b is None:
        return "error", f"NVML did not answer for GPU {gpu} before and after the tests", evidence
    problems: list[str] = []
    eb, ea = b["ecc_uncorrected_volatile"], a["ecc_uncorrected_volatile"]
    if ea is not None and ea > (eb or 0):
        problems.append(f"uncorrectable ECC errors rose {eb or 0} -> {ea}")
    rb, ra = b["remapped_rows"] or {}, a["remapped_rows"] or {}
    if ra.get("uncorrectable", 0) > rb.get("uncorrectable", 0):
        problems.append(f"rows remapped for uncorrectable errors rose {rb.get('uncorrectable', 0)} -> "
                        f"{ra['uncorrectable']}")
    if ra.get("pending") and not rb.get("pending"):
        problems.append("a row remap is now pending (applied at the next reset)")
    if ra.get("failure"):
        problems.append("a row remap has failed")
    if a["retired_pending"] and not b["retired_pending"]:
        problems.append("a retired page now waits for a reset")
    xids = _new_xids(before, after, a.get("bus_id"))
    evidence.append({"name": "xids_during_tests", "value": xids, "source": "/dev/kmsg",
                     **({"error": after["xid_error"]} if after["xid_error"] else {})})
    for x in xids:
        meaning = describe_xid(x["xid"])
        problems.append(f"Xid {x['xid']} ({meaning.meaning}) during the tests")
    if problems:
        return "fail", "; ".join(problems), evidence
    slow = [r for r in a["clock_events"] or [] if r in SLOWDOWN_REASONS]
    if slow:
        return "warn", f"clocks held down after the tests: {', '.join(slow)}", evidence
    note = "" if not after["xid_error"] else f" (Xids not read: {after['xid_error']})"
    return "pass", "no new ECC errors, remaps, retired pages or Xids; no slowdown" + note, evidence


def snapshot_gpu_clock_events(gpu: int) -> list[str] | None:
    """The clock event reasons of one GPU now (sampled during the stress test)."""
    from zerod.checks.probe_nvml import NvmlUnavailable, session

    try:
        N = session()
        h = N.nvmlDeviceGetHandleByIndex(gpu)
        fn = getattr(N, "nvmlDeviceGetCurrentClocksEventReasons", None) or N.nvmlDeviceGetCurrentClocksThrottleReasons
        return reasons_from_mask(int(fn(h)))
    except (NvmlUnavailable, Exception):  # noqa: BLE001 - no sample this time
        return None
