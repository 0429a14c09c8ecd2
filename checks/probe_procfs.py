"""Probe /proc (and the few files under / that describe the running kernel)."""

from __future__ import annotations

import errno
import gzip
import os
import re

from .facts import Facts, Roots, read_into, read_text
from .xid import parse_kmsg_xids


def probe(facts: Facts, roots: Roots) -> None:
    release = read_into(facts, "kernel.release", roots.proc("sys/kernel/osrelease"))
    read_into(facts, "kernel.numa_balancing", roots.proc("sys/kernel/numa_balancing"), _int)
    read_into(facts, "kernel.io_uring_disabled", roots.proc("sys/kernel/io_uring_disabled"), _int)
    _kernel_config(facts, roots, release)
    read_into(facts, "kernel.modules", roots.proc("modules"),
              lambda s: sorted({line.split()[0] for line in s.splitlines() if line.strip()}))
    read_into(facts, "driver.proc_version", roots.proc("driver/nvidia/version"), _nvidia_version)
    read_into(facts, "mem.memlock", roots.proc("self/limits"), _memlock)
    read_into(facts, "self.status", roots.proc("self/status"), _status)
    read_into(facts, "kernel.cmdline", roots.proc("cmdline"), str.strip)
    read_into(facts, "mem.swap", roots.proc("meminfo"), _swap)
    read_into(facts, "mem.swap_devices", roots.proc("swaps"), _swaps)
    read_into(facts, "vm.swappiness", roots.proc("sys/vm/swappiness"), _int)
    probe_xids(facts, roots)


def _int(s: str) -> int:
    return int(s.strip())


def _nvidia_version(s: str) -> dict:
    # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
    m = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", s)
    return {"version": m.group(1) if m else None, "open": "Open Kernel Module" in s,
            "line": s.splitlines()[0] if s else ""}


def _memlock(s: str) -> dict:
    for line in s.splitlines():
        if line.startswith("Max locked memory"):
            soft, hard = line[len("Max locked memory"):].split()[:2]
            conv = lambda v: None if v == "unlimited" else int(v)  # noqa: E731
            return {"soft": conv(soft), "hard": conv(hard)}
    raise ValueError("no 'Max locked memory' line")


def _swap(s: str) -> dict:
    """SwapTotal/SwapFree of /proc/meminfo, in bytes."""
    kib = {}
    for line in s.splitlines():
        k, _, v = line.partition(":")
        if k in ("SwapTotal", "SwapFree"):
            kib[k] = int(v.split()[0]) * 1024
    if len(kib) != 2:
        raise ValueError("no SwapTotal/SwapFree lines")
    return {"total_bytes": kib["SwapTotal"], "free_bytes": kib["SwapFree"]}


def _swaps(s: str) -> list[dict]:
    """/proc/swaps: 'Filename Type Size Used Priority', sizes in KiB."""
    out = []
    for line in s.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 5:
            out.append({"name": parts[0], "type": parts[1], "size_bytes": int(parts[2]) * 1024,
                        "used_bytes": int(parts[3]) * 1024, "priority": int(parts[4])})
    return out


def _status(s: str) -> dict:
    out = {}
    for line in s.splitlines():
        k, _, v = line.partition(":")
        if k in ("Cpus_allowed_list", "Mems_allowed_list", "Pid", "Name"):
            out[k] = v.strip()
    return out


def _kernel_config(facts: Facts, roots: Roots, release: str | None) -> None:
    """CONFIG_IO_URING and friends from /proc/config.gz, else /boot/config-$(uname -r)."""
    tried = []
    candidates = [roots.proc("config.gz")]
    if release:
        candidates.append(roots.root(f"boot/config-{release}"))
    for path in candidates:
        try:
            if path.endswith(".gz"):
                with gzip.open(path, "rt", errors="replace") as f:
                    text = f.read()
            else:
                text = read_text(path, limit=1 << 22)
        except FileNotFoundError:
            tried.append(f"{path} does not exist")
            continue
        except (OSError, EOFError) as exc:
            tried.append(f"{path}: {exc}")
            continue
        wanted = ("CONFIG_IO_URING", "CONFIG_NUMA_BALANCING", "CONFIG_NUMA")
        cfg = {}
        for line in text.splitlines():
            m = re.match(r"(CONFIG_\w+)=(\S+)", line) or re.match(r"# (CONFIG_\w+) is not set", line)
            if m and m.group(1) in wanted:
                cfg[m.group(1)] = m.group(2) if m.lastindex == 2 else "n"
        facts.put("kernel.config", cfg, path)
        return
    facts.fail("kernel.config", "; ".join(tried) or "kernel release unknown", candidates[-1],
               missing=all("does not exist" in t for t in tried))


def probe_xids(facts: Facts, roots: Roots) -> None:
    """NVIDIA Xid lines from the kernel ring buffer (/dev/kmsg, read without blocking)."""
    path = roots.root("dev/kmsg")
    try:
        uptime = float(read_text(roots.proc("uptime")).split()[0])
    except (OSError, ValueError, IndexError):
        uptime = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        facts.fail("kernel.xid_events", f"{path} does not exist", path, missing=True)
        return
    except OSError as exc:
        facts.fail("kernel.xid_events",
                   f"cannot read the kernel log {path}: {exc.strerror} (dmesg is restricted to root)", path)
        return
    chunks: list[bytes] = []
    total = 0
    try:
        while total < (8 << 20):
            try:
                b = os.read(fd, 65536)  # /dev/kmsg hands out one record per read
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # record overwritten while reading: go on
                    continue
                raise
            if not b:
                break
            chunks.append(b)
            total += len(b)
    except OSError as exc:
        facts.fail("kernel.xid_events", f"{path}: {exc.strerror}", path)
        return
    finally:
        os.close(fd)
    text = b"".join(c if c.endswith(b"\n") else c + b"\n" for c in chunks).decode("utf-8", "replace")
    facts.put("kernel.xid_events", {"uptime_s": uptime, "events": parse_kmsg_xids(text)}, path)
