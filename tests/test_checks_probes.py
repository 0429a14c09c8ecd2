"""The probes' parsers and the live probes that need no GPU (netlink, torch's version.py)."""

from __future__ import annotations

import json

from test_checks_helpers import load

from zerod.checks import Facts, Roots, probe_facts, run_checks
from zerod.checks.probe_net import addresses
import pytest

from zerod.checks.clock_events import CLOCK_EVENTS, reasons_from_mask
from zerod.checks.cpulist import parse_cpulist
from zerod.checks.pci import normalize_bdf
from zerod.checks.probe_sysfs import selected
from zerod.checks.probe_torch import torch_install
from zerod.checks.render import render
from zerod.checks.xid import describe, parse_kmsg_xids


def test_xid_lines_from_kmsg_and_dmesg():
    text = ("4,812,1234567890,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=, GPU has fallen off the bus.\n"
            "6,813,1234567891,-;nvidia-modeset: something else\n"
            "[ 4242.123456] NVRM: Xid (PCI:0000:af:00): 13, pid=77, name=python3, Graphics Exception\n"
            " SUBSYSTEM=pci\n")
    ev = parse_kmsg_xids(text)
    assert [(e["xid"], e["pci"], e["t_s"]) for e in ev] == [(79, "0000:3b:00", 1234.56789),
                                                            (13, "0000:af:00", 4242.123456)]
    assert describe(79).critical and not describe(13).critical and describe(99999).critical


def test_small_parsers():
    assert selected("always [madvise] never\n") == "madvise"
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("3,1-2,2") == [1, 2, 3]
    assert parse_cpulist("") == parse_cpulist(None) == []


@pytest.mark.parametrize("text", ["x", "3-1", "0-99999999", "-1", "1-2-3"])
def test_cpulist_refuses_what_the_kernel_never_writes(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_pci_bus_ids_as_sysfs_names_them():
    assert normalize_bdf("00000000:18:00.0") == "0000:18:00.0"  # NVML's 8-digit domain
    assert normalize_bdf(b"00000000:AF:00.0") == "0000:af:00.0"  # old nvml-ml-py gives bytes
    assert normalize_bdf("0000:3b:00.0\n") == "0000:3b:00.0"
    assert normalize_bdf("00010000:01:00.0") == "10000:01:00.0"  # a VMD domain keeps its digits
    assert normalize_bdf("garbage") == "garbage"


def test_daemon_and_doctor_name_clock_events_alike():
    from zerod.checks.gpu_reading import GpuReading

    mask = 0x8 | 0x20 | 0x100
    assert GpuReading(index=0, clock_events_mask=mask).clock_events_active == reasons_from_mask(mask) == [
        "hw_slowdown", "sw_thermal_slowdown", "display_clock_setting"]
    assert [CLOCK_EVENTS[b].level for b in (0x8, 0x20, 0x100)] == ["fail", "warn", None]


def test_addresses_list_loopback_with_its_prefix():
    addrs = addresses()
    assert {"ifname": "lo", "family": 4, "address": "127.0.0.1", "prefixlen": 8} == next(
        a for a in addrs if a["address"] == "127.0.0.1")
    assert {"ifname": "lo", "family": 6, "address": "::1", "prefixlen": 128} in addrs
    assert all("%" not in a["address"] for a in addrs)  # link-local zones are stripped


def test_doctor_imports_no_pyroute2():
    import subprocess
    import sys

    code = ("import sys; from zerod.checks import probe_facts, run_checks; run_checks(probe_facts()); "
            "print('pyroute2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_torch_version_read_as_text():
    info = torch_install()
    assert info["version"] and info["path"].endswith("torch/version.py")
    assert "cuda" in info  # None on this CPU build, "13.0" on the H200
    assert load("h200").value("torch.install")["cuda"] == "13.0"


def test_probe_facts_is_json_and_replays(tmp_path):
    facts = probe_facts(Roots.make())
    again = Facts.from_json(facts.to_json())
    assert json.loads(again.to_json()) == json.loads(facts.to_json())
    assert [c.status for c in run_checks(again).checks] == [c.status for c in run_checks(facts).checks]
    assert set(facts.meta["timings_ms"]) >= {"procfs", "sysfs", "nvml", "processes", "net", "torch"}


def test_colour_only_when_asked():
    report = run_checks(load("sick-gpu"))
    plain, coloured = render(report), render(report, colour=True)
    assert "\x1b[" not in plain and "\x1b[31" in coloured  # red for FAIL
    import re

    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain
