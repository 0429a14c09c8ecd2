"""Probe the host's addresses with psutil (getifaddrs).

`psutil.net_if_addrs()` gives every interface's addresses and netmasks, which is all
`net.bind_exposure` reads, in well under a millisecond. pyroute2 would read the same
from rtnetlink but costs ~0.3 s to import; doctor never imports it (the daemon's netlink
subscription does, for link and address events).
"""

from __future__ import annotations

import ipaddress
import socket

from .facts import Facts

SOURCE = "psutil.net_if_addrs()"


def _prefixlen(netmask: str | None) -> int | None:
    """255.255.255.0 -> 24, ffff:ffff:ffff:ffff:: -> 64 (psutil gives masks, not lengths)."""
    try:
        bits = bin(int(ipaddress.ip_address(netmask or "")))[2:]
    except ValueError:
        return None
    return bits.count("1") if "01" not in bits else None


def addresses() -> list[dict]:
    """[{ifname, family (4|6), address, prefixlen}] for every IPv4/IPv6 address."""
    import psutil

    out = []
    for ifname, lst in psutil.net_if_addrs().items():
        for a in lst:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            out.append({"ifname": ifname, "family": 4 if a.family == socket.AF_INET else 6,
                        "address": a.address.split("%")[0],  # fe80::1%eth0: the zone is the ifname
                        "prefixlen": _prefixlen(a.netmask)})
    return out


def probe(facts: Facts) -> None:
    try:
        facts.put("net.addresses", addresses(), SOURCE)
    except Exception as exc:  # noqa: BLE001 - the reason is the fact
        facts.fail("net.addresses", f"cannot list the interfaces: {type(exc).__name__}: {exc}", SOURCE)
