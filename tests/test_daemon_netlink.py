"""Link and address events: the handling on pyroute2's own message objects
(ifinfmsg, ifaddrmsg, as the kernel's messages decode), and — where this
sandbox lets root create a veth pair — the real rtnetlink subscription."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections import namedtuple

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from zerod.alerts import AlertBook
from zerod.preflight import Preflight
from zerod.watchers.netlink import NetlinkWatcher, serving_links

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
HOST_ADDRS = {"lo": [Addr(socket.AF_INET, "127.0.0.1", None, None, None)],
              "eth0": [Addr(socket.AF_INET, "10.1.2.3", None, None, None),
                       Addr(socket.AF_INET6, "fe80::1%eth0", None, None, None)],
              "ib0": [Addr(socket.AF_INET, "192.168.50.7", None, None, None)],
              "docker0": []}


def link(event, name, flags):
    m = ifinfmsg()
    m["event"], m["flags"], m["attrs"] = event, flags, [("IFLA_IFNAME", name)]
    return m


def address(event, name, addr):
    m = ifaddrmsg()
    m["event"], m["attrs"] = event, [("IFA_LABEL", name), ("IFA_ADDRESS", addr)]
    return m


def test_the_links_an_engine_serves_on():
    assert serving_links("0.0.0.0", HOST_ADDRS) == {"eth0", "ib0"}
    assert serving_links("10.1.2.3", HOST_ADDRS) == {"eth0"}
    assert serving_links("127.0.0.1", HOST_ADDRS) == {"lo"}
    assert serving_links("::", HOST_ADDRS) == {"eth0", "ib0"}
    assert serving_links("inference.example", HOST_ADDRS) == set()


async def test_link_down_alerts_address_change_rechecks():
    book, rechecks = AlertBook(), []
    w = NetlinkWatcher(book, 1.0, "10.1.2.3", lambda: rechecks.append(1),
                       links=lambda host: serving_links(host, HOST_ADDRS), socket_factory=lambda: None)
    w.note = "no socket in this test"  # apoll must not start the thread
    w.handle(link("RTM_NEWLINK", "ib0", 0x1002))  # another link: not the engine's
    assert not book.firing()
    w.handle(link("RTM_NEWLINK", "eth0", 0x11003))  # up, no carrier
    [a] = book.firing()
    assert a.alertname == "EngineLinkDown" and a.key == "eth0" and a.severity == "critical"
    assert "no carrier" in a.summary and a.labels == {"interface": "eth0"}
    w.handle(link("RTM_NEWLINK", "eth0", 0x11043))  # carrier back
    assert not book.firing()
    w.handle(link("RTM_NEWLINK", "eth0", 0x1002))
    assert "administratively down" in book.get("EngineLinkDown", "eth0").summary
    w.handle(link("RTM_NEWLINK", "eth0", 0x11043))
    # an address change: net.bind_exposure again, once per tick however many events came
    w.handle(address("RTM_NEWADDR", "eth0", "203.0.113.9"))
    w.handle(address("RTM_DELADDR", "eth0", "10.1.2.3"))
    assert rechecks == []
    await w.apoll()
    await w.apoll()
    assert rechecks == [1] and w.events == 7


def test_an_address_change_reruns_bind_exposure_alone(monkeypatch):
    from zerod.checks import probe_net

    book = AlertBook()
    pre = Preflight({"engine": {"host": "0.0.0.0", "model": "demo"}}, book, enabled=False)
    addrs = [{"ifname": "eth0", "family": 4, "address": "10.1.2.3", "prefixlen": 24}]
    monkeypatch.setattr(probe_net, "probe", lambda facts: facts.put("net.addresses", list(addrs), "test"))
    pre.recheck_bind_exposure()
    assert not book.firing()
    addrs.append({"ifname": "eth0", "family": 4, "address": "93.184.216.34", "prefixlen": 24})  # a public one
    pre.recheck_bind_exposure()
    [a] = book.firing()
    assert a.alertname == "PreflightFailed" and a.key == "net.bind_exposure" and "93.184.216.34" in a.description
    addrs.pop()
    pre.recheck_bind_exposure()
    assert not book.firing()


def _ip(cmd: str) -> bool:
    return subprocess.run(["ip", *cmd.split()], capture_output=True).returncode == 0


@pytest.fixture
def veth():
    try:
        ok = _ip("link add zdtest0 type veth peer name zdtest1")
    except FileNotFoundError:
        ok = False
    if not ok:
        pytest.skip("cannot create a veth pair here (needs root and CAP_NET_ADMIN)")
    try:
        yield "zdtest0", "zdtest1"
    finally:
        _ip("link del zdtest0")


def test_real_netlink_subscription(veth):
    mine, peer = veth
    book, rechecks = AlertBook(), []
    w = NetlinkWatcher(book, 1.0, "10.77.0.1", lambda: rechecks.append(1))
    w.start()
    assert w.note is None, w.note
    try:
        assert _ip(f"addr add 10.77.0.1/24 dev {mine}") and _ip(f"link set {peer} up") and _ip(f"link set {mine} up")

        def wait(cond, what):
            end = time.monotonic() + 5
            while time.monotonic() < end and not cond():
                time.sleep(0.02)
            assert cond(), what

        wait(lambda: w.events >= 3, "the kernel's events")
        asyncio.run(w.apoll())  # the address came: bind_exposure again, and the link is the engine's now
        assert rechecks and mine in w.serving
        wait(lambda: not book.firing(), "the link up")
        assert _ip(f"link set {peer} down")  # the peer goes: our side loses its carrier
        wait(lambda: book.get("EngineLinkDown", mine) is not None, "EngineLinkDown")
        assert "no carrier" in book.get("EngineLinkDown", mine).summary
        assert _ip(f"link set {peer} up")
        wait(lambda: book.get("EngineLinkDown", mine) is None, "EngineLinkDown resolved")
    finally:
        w.stop()
