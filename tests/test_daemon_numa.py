"""NUMA pinning: the GPU's node from sysfs, its CPUs, and the shim that applies
affinity and the memory policy in the child before exec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import os

from zerod import numa

ROOT = Path(__file__).resolve().parent.parent


def fake_sysfs(tmp_path, node=1, bdf="0000:18:00.0"):
    sysfs = tmp_path / "sys"
    dev = sysfs / "bus/pci/devices" / bdf
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    for n, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        d = sysfs / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (sysfs / "devices/system/node/online").write_text("0-1\n")
    return str(sysfs)


def test_cpulist_round_trip():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert numa.normalize_bdf("00000000:18:00.0") == "0000:18:00.0"


def test_plan_binding_from_sysfs(tmp_path):
    sysfs = fake_sysfs(tmp_path)
    b = numa.plan_binding("00000000:18:00.0", "bind", sysfs, allowed=set(range(16)))
    assert b.active and b.node == 1 and b.cpulist == "4-7,12-15"
    # a cgroup cpuset narrower than the node
    b = numa.plan_binding("00000000:18:00.0", "bind", sysfs, allowed={4, 5, 0})
    assert b.cpulist == "4-5"
    b = numa.plan_binding("00000000:18:00.0", "bind", sysfs, allowed={0})
    assert not b.active and "not pinned" in b.reason
    assert not numa.plan_binding(None).active


def test_numa_node_minus_one_on_a_one_node_host(tmp_path):
    sysfs = tmp_path / "sys"
    dev = sysfs / "bus/pci/devices/0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("-1\n")
    (sysfs / "devices/system/node").mkdir(parents=True)
    (sysfs / "devices/system/node/online").write_text("0\n")
    assert numa.gpu_numa_node("0000:18:00.0", sysfs) == 0


def test_shim_applies_affinity_and_memory_policy_then_execs():
    cpu = sorted(os.sched_getaffinity(0))[0]
    node = 0
    code = ("import os; print(sorted(os.sched_getaffinity(0))); "
            "print(open('/proc/self/numa_maps').readline().split()[1])")
    b = numa.Binding(node, [cpu], "bind")
    cmd = numa.wrap_command([sys.executable, "-c", code], b)
    assert cmd[:3] == [sys.executable, "-m", "zerod.numa"] and "--parent" in cmd
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split("\n")
    assert out[0] == f"[{cpu}]"
    assert out[1] == f"bind:{node}", r.stdout + r.stderr


def test_shim_refuses_when_its_parent_is_gone():
    r = subprocess.run([sys.executable, "-m", "zerod.numa", "--parent", "1", "--", "true"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "parent 1 is gone" in r.stderr
