"""PCI addresses: NVML spells a GPU's bus id '00000000:18:00.0' (8-digit domain),
sysfs names the device '0000:18:00.0'. zerod.numa, the NVML probe and the daemon
use this one normaliser."""

from __future__ import annotations


def normalize_bdf(bus_id: str | bytes) -> str:
    """NVML's '00000000:18:00.0' (or bytes) -> sysfs's '0000:18:00.0'; a domain
    above 0xffff keeps its digits, as sysfs does. Anything else comes back lowered."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    bus_id = bus_id.strip().lower()
    dom, _, rest = bus_id.partition(":")
    try:
        return f"{int(dom, 16):04x}:{rest}" if rest else bus_id
    except ValueError:
        return bus_id
