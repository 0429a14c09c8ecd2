"""Probe whether doctor runs in a container and, if so, what the NVIDIA runtime gave it.

Inside a container the GPUs arrive only through the NVIDIA container toolkit: it
mounts the device nodes and the driver's user-space libraries (libnvidia-ml and
friends) and adds the device-cgroup rules that let the container open the nodes.
Opening each node is the one test that works for cgroup v1 and v2 alike (v2 enforces
device rules in an eBPF program nobody can read back); NVML opens them anyway.
"""

from __future__ import annotations

import errno
import os
import re

from .facts import Facts, Roots, read_text
from .gpu_processes import parse_cgroup

MARKERS = ((".dockerenv", "docker"), ("run/.containerenv", "podman"))
# Where distributions and the toolkit put libnvidia-ml.so.1.
LIBDIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib",
           "usr/local/nvidia/lib64")
DEVICE = re.compile(r"nvidia(ctl|-uvm|\d+)$")  # what a CUDA or NVML process opens


def _environ(path: str) -> dict[str, str]:
    try:
        raw = read_text(path)
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def detect(roots: Roots) -> dict:
    """{in_container, runtime, evidence, nvidia_env}."""
    evidence, runtime = [], None
    for rel, rt in MARKERS:
        if os.path.exists(roots.root(rel)):
            evidence.append(f"/{rel} exists")
            runtime = runtime or rt
    env = _environ(roots.proc("self/environ"))
    if "KUBERNETES_SERVICE_HOST" in env:
        evidence.append("KUBERNETES_SERVICE_HOST is set")
        runtime = "kubernetes"
    pid1 = _environ(roots.proc("1/environ")).get("container")  # podman, lxc, systemd-nspawn
    if pid1:
        evidence.append(f"pid 1 has container={pid1}")
        runtime = runtime or pid1
    try:
        _unit, container = parse_cgroup(read_text(roots.proc("self/cgroup")))
    except OSError:
        container = None
    if container:
        evidence.append(f"cgroup of a container ({container})")
        runtime = runtime or container.split(":")[0]
    return {"in_container": bool(evidence), "runtime": runtime, "evidence": evidence,
            "nvidia_env": {k: v for k, v in sorted(env.items()) if k.startswith("NVIDIA_")}}


def _open(path: str) -> str:
    try:
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        return "ok"
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"


def nvidia_runtime(roots: Roots) -> dict:
    """{device_nodes, open: {node: "ok" | "EPERM: ..."}, libnvidia_ml: [paths]}."""
    try:
        nodes = sorted(f"/dev/{n}" for n in os.listdir(roots.root("dev")) if DEVICE.fullmatch(n))
    except OSError:
        nodes = []
    libs = [f"/{d}/libnvidia-ml.so.1" for d in LIBDIRS if os.path.exists(roots.root(f"{d}/libnvidia-ml.so.1"))]
    return {"device_nodes": nodes, "open": {n: _open(roots.root(n)) for n in nodes}, "libnvidia_ml": libs}


def probe(facts: Facts, roots: Roots) -> None:
    found = facts.put("container", detect(roots),
                      "/.dockerenv, /run/.containerenv, /proc/self/environ, /proc/1/environ, /proc/self/cgroup")
    if found["in_container"]:
        facts.put("container.nvidia", nvidia_runtime(roots),
                  "/dev/nvidia*, opened read-write; libnvidia-ml.so.1 in the library folders")
