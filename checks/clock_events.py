"""NVML clock event (throttle) reasons: the bit of each, the name docs/control-api.md
and the metrics use, and what doctor makes of it while active. The daemon's NVML
watcher and its metrics use the same table."""

from __future__ import annotations

from typing import NamedTuple


class ClockEvent(NamedTuple):
    name: str
    level: str | None  # doctor's verdict while active: "fail", "warn", or None (benign)


# nvmlClocksEventReason* bits (nvml.h).
CLOCK_EVENTS: dict[int, ClockEvent] = {
    0x1: ClockEvent("gpu_idle", None),
    0x2: ClockEvent("applications_clocks_setting", None),
    0x4: ClockEvent("sw_power_cap", None),
    0x8: ClockEvent("hw_slowdown", "fail"),
    0x10: ClockEvent("sync_boost", None),
    0x20: ClockEvent("sw_thermal_slowdown", "warn"),
    0x40: ClockEvent("hw_thermal_slowdown", "fail"),
    0x80: ClockEvent("hw_power_brake_slowdown", "fail"),
    0x100: ClockEvent("display_clock_setting", None),
}
CLOCK_EVENT_REASONS: dict[int, str] = {bit: e.name for bit, e in CLOCK_EVENTS.items()}


def reasons_from_mask(mask: int) -> list[str]:
    """The names of the reasons set in an NVML mask, in bit order."""
    return [e.name for bit, e in CLOCK_EVENTS.items() if mask & bit]
