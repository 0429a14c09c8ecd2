"""Link and address events from the kernel: rtnetlink through pyroute2.

A thread waits on a netlink socket bound to RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR
and RTNLGRP_IPV6_IFADDR (no polling: the kernel says when something changes).
`handle()` takes pyroute2's message objects, so the logic is tested without a
socket:

- an address added or removed re-runs `net.bind_exposure` at the next tick
  (an engine bound to 0.0.0.0 is exposed on a public address the moment one
  appears), which raises or resolves `PreflightFailed` for that check alone;
- a link the engine serves on — the one holding its bind address, or for a
  wildcard bind every non-loopback link with an address — going down (admin
  down, carrier lost, removed) raises `EngineLinkDown` (critical: clients cannot
  reach the engine through it); it resolves when the link is up again.

pyroute2 is imported here only (doctor reads addresses with psutil and stays fast).
A netlink socket that cannot be opened (a sandbox without it) is logged once;
the daemon runs on without these events.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import select
import socket
import threading
from typing import Any, Callable

import psutil

from zerod.alerts import AlertBook
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher

log = logging.getLogger("zerod.netlink")

IFF_UP, IFF_RUNNING = 0x1, 0x40
LINK_EVENTS = ("RTM_NEWLINK", "RTM_DELLINK")
ADDRESS_EVENTS = ("RTM_NEWADDR", "RTM_DELADDR")


def open_socket() -> Any:
    from pyroute2 import IPRSocket
    from pyroute2.netlink.rtnl import RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR, RTMGRP_LINK

    s = IPRSocket()
    s.bind(groups=RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR)
    return s


def serving_links(bind_host: str, addrs: dict[str, list] | None = None) -> set[str]:
    """The interfaces through which clients reach an engine bound to `bind_host`."""
    addrs = psutil.net_if_addrs() if addrs is None else addrs
    host = "127.0.0.1" if bind_host in ("localhost", "") else bind_host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return set()  # a name: where it points is DNS's business
    out = set()
    for ifname, lst in addrs.items():
        for a in lst:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                mine = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_unspecified:
                if not mine.is_loopback and (mine.version == ip.version or ip.version == 6):
                    out.add(ifname)
            elif mine == ip:
                out.add(ifname)
    return out


@owns(alerts=(AlertRule("EngineLinkDown", "critical", "a link an engine serves on is down (admin down, no "
                        "carrier, removed); an address change re-runs `net.bind_exposure` instead"),))
class NetlinkWatcher(Watcher):
    name = "netlink"
    blocking = False

    def __init__(self, book: AlertBook, interval_s: float, bind_hosts: str | tuple[str, ...],
                 recheck: Callable[[], None],
                 *, links: Callable[[str], set[str]] = serving_links,
                 socket_factory: Callable[[], Any] = open_socket) -> None:
        super().__init__()
        self.book = book
        self.interval_s = interval_s
        # every engine's bind address: a link any of them serves on is watched
        self.bind_hosts = (bind_hosts,) if isinstance(bind_hosts, str) else tuple(bind_hosts)
        self.recheck = recheck
        self.links = links
        self.socket_factory = socket_factory
        self.serving: set[str] = self._serving_now()
        self.down: set[str] = set()
        self.events = 0
        self.rechecks = 0
        self.note: str | None = None  # why there are no events, when there are none
        self._recheck_due = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def _serving_now(self) -> set[str]:
        return set().union(*(self.links(h) for h in self.bind_hosts))

    # --- the events ---------------------------------------------------------
    def handle(self, msg: Any) -> None:
        event = msg.get("event")
        with self._lock:
            self.events += 1
            if event in ADDRESS_EVENTS:
                self._recheck_due = True
                return
            if event not in LINK_EVENTS:
                return
            ifname = msg.get_attr("IFLA_IFNAME")
            if not ifname:
                return
            flags = msg.get("flags") or 0
            up = event == "RTM_NEWLINK" and bool(flags & IFF_UP) and bool(flags & IFF_RUNNING)
            serving = ifname in self.serving or ifname in self.down
        if not serving:
            return
        if up:
            with self._lock:
                self.down.discard(ifname)
            self.book.resolve("EngineLinkDown", ifname)
            return
        why = ("removed" if event == "RTM_DELLINK" else
               "administratively down" if not flags & IFF_UP else "no carrier (cable, switch port or peer down)")
        with self._lock:
            self.down.add(ifname)
        self.book.fire("EngineLinkDown", ifname, severity="critical",
                       summary=f"link {ifname}, which the engine serves on, is down: {why}",
                       description=f"the engine listens on {', '.join(self.bind_hosts)}; clients reach it through {ifname}, "
                                   f"which the kernel reports {why}",
                       labels={"interface": ifname},
                       fix=f"ip link show {ifname}; check the cable, the switch port and the NIC (ethtool {ifname})")

    # --- the loop -----------------------------------------------------------
    async def apoll(self) -> None:
        if self._thread is None and self.note is None:
            self.start()
        with self._lock:
            due, self._recheck_due = self._recheck_due, False
        if due:
            self.serving = self._serving_now() | self.down
            self.rechecks += 1
            await asyncio.get_running_loop().run_in_executor(None, self.recheck)

    def start(self) -> None:
        try:
            sock = self.socket_factory()
        except Exception as exc:  # no pyroute2, no netlink in this sandbox
            self.note = f"no link/address events: {type(exc).__name__}: {exc}"
            log.warning("%s", self.note)
            return
        self._thread = threading.Thread(target=self._run, args=(sock,), name="zerod-netlink", daemon=True)
        self._thread.start()

    def _run(self, sock: Any) -> None:
        try:
            while not self._stop.is_set():
                if not select.select([sock], [], [], 0.5)[0]:
                    continue
                for msg in sock.get():
                    self.handle(msg)
        except Exception as exc:
            if not self._stop.is_set():
                self.note = f"netlink events stopped: {type(exc).__name__}: {exc}"
                log.warning("%s", self.note)
        finally:
            try:
                sock.close()
            except Exception:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def stats(self) -> dict:
        return {**super().stats(), "events": self.events, "rechecks": self.rechecks, "note": self.note}
