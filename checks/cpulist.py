"""The kernel's CPU/node list format ('0-3,8,10-11'), as in sysfs cpulist files and
/proc/PID/status *_allowed_list. zerod.numa and the doctor checks use this one parser."""

from __future__ import annotations

# Far above any real host; bounds what a damaged file or snapshot can make us allocate.
MAX_CPUS = 1 << 16


def parse_cpulist(text: str | None) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (sorted, unique); '' or None -> [].
    Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a, b = int(lo), int(hi if sep else lo)
        if a < 0 or b < a or b >= MAX_CPUS:
            raise ValueError(f"bad CPU range {part!r} in cpulist {text!r}")
        cpus.update(range(a, b + 1))
    return sorted(cpus)
