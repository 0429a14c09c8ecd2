"""NVIDIA Xid error codes: what each means and what to do (the daemon's XID watcher
uses the same table), and a parser for the kernel log lines that carry them."""

from __future__ import annotations

import re
from typing import NamedTuple


class Xid(NamedTuple):
    meaning: str
    critical: bool  # hardware/driver trouble, as opposed to an application's own fault
    action: str


_RESET = "drain the GPU, then reset it (`sudo nvidia-smi -r -i GPU`) or reboot"
_APP = "usually the application's fault: check the process named in the log line"

XIDS: dict[int, Xid] = {
    13: Xid("graphics engine exception", False, _APP),
    31: Xid("GPU memory page fault", False, _APP),
    32: Xid("invalid or corrupted push buffer stream", False, _APP),
    43: Xid("GPU stopped processing", False, _APP),
    45: Xid("preemptive cleanup after a previous error", False, "follows another Xid: look at that one"),
    48: Xid("double-bit ECC error", True, _RESET + "; if it repeats, replace the GPU"),
    61: Xid("internal micro-controller breakpoint", True, _RESET),
    62: Xid("internal micro-controller halt", True, _RESET),
    63: Xid("ECC page retirement or row remapping event", True, _RESET + " to apply the remap"),
    64: Xid("ECC page retirement or row remapping failure", True, "replace the GPU (RMA)"),
    74: Xid("NVLink error", True, _RESET + "; check the NVLink cabling/bridge if it repeats"),
    79: Xid("GPU has fallen off the bus", True, "reboot; check power, cooling and PCIe seating"),
    92: Xid("high single-bit ECC error rate", True, _RESET + "; watch for replacement"),
    94: Xid("contained ECC error", True, _RESET),
    95: Xid("uncontained ECC error", True, _RESET),
    109: Xid("context switch timeout", False, _APP),
    119: Xid("GSP RPC timeout", True, _RESET + "; update the driver if it repeats"),
    120: Xid("GSP error", True, _RESET + "; update the driver if it repeats"),
    140: Xid("unrecovered ECC error", True, _RESET),
    154: Xid("GPU recovery action changed", True, "do what nvidia-smi -q shows under GPU Recovery Action"),
}


def describe(code: int) -> Xid:
    return XIDS.get(code, Xid("unknown Xid", True, "see NVIDIA's Xid catalogue; " + _RESET))


# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),(.*)")


def parse_kmsg_xids(text: str) -> list[dict]:
    """Xid events from /dev/kmsg records ("pri,seq,usec,flags;msg") or dmesg lines
    ("[  12.345678] msg"); `t_s` is seconds since boot when the line has it."""
    out = []
    for line in text.splitlines():
        m = _XID.search(line)
        if not m:
            continue
        t = None
        head = line[: m.start()]
        if ";" in head:
            parts = head.split(";", 1)[0].split(",")
            if len(parts) >= 3 and parts[2].isdigit():
                t = int(parts[2]) / 1e6
        else:
            tm = re.match(r"\s*\[\s*(\d+\.\d+)\]", head)
            if tm:
                t = float(tm.group(1))
        out.append({"t_s": t, "pci": m.group(1), "xid": int(m.group(2)), "text": m.group(3).strip()[:200]})
    return out[-200:]
