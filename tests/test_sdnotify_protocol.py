"""sd_notify over a fake NOTIFY_SOCKET: path and abstract names, the watchdog
variables, a receiver that stops reading, and the child's environment."""

from __future__ import annotations

import os
import socket

from zerod.sdnotify import Notifier, child_environment, socket_address


def _listener(tmp_path, abstract=False):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"zerod-sdnotify-test-{os.getpid()}"
        s.bind("\0" + name)
        addr = "@" + name
    else:
        addr = str(tmp_path / "notify")
        s.bind(addr)
    s.settimeout(2)
    return s, addr


def test_path_socket_messages(tmp_path):
    s, addr = _listener(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.enabled and n.watchdog_enabled and n.watchdog_usec == 4_000_000
    assert n.extend_timeout(30)
    assert n.ready("serving demo")
    assert n.watchdog()
    assert n.stopping()
    got = [s.recv(4096).decode() for _ in range(4)]
    assert got == ["EXTEND_TIMEOUT_USEC=30000000", "READY=1\nSTATUS=serving demo", "WATCHDOG=1", "STOPPING=1"]
    n.close()
    s.close()


def test_abstract_socket(tmp_path):
    s, addr = _listener(tmp_path, abstract=True)
    assert socket_address(addr) == b"\0" + addr[1:].encode()
    n = Notifier({"NOTIFY_SOCKET": addr})
    assert n.status("loading\nmodel")
    assert s.recv(4096) == b"STATUS=loading model"
    assert not n.watchdog_enabled  # no WATCHDOG_USEC: the watchdog is off
    s.close()


def test_no_socket_is_a_noop_and_foreign_watchdog_pid_is_ignored():
    n = Notifier({})
    assert not n.enabled and not n.ready() and not n.watchdog()
    m = Notifier({"NOTIFY_SOCKET": "/nonexistent/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert m.watchdog_usec == 0
    assert m.ready() is False  # the send fails, quietly


def test_a_receiver_that_stops_reading_never_blocks_the_sender(tmp_path):
    s, addr = _listener(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": addr})
    results = [n.watchdog() for _ in range(5000)]  # far beyond the datagram queue
    assert results[0] is True and results[-1] is False
    s.close()


def test_child_environment_drops_the_notify_variables():
    env = child_environment({"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
                             "PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin"}
