"""Who holds the GPU: NVML's process lists plus a /proc/*/fd scan for /dev/nvidia*.

NVML lists processes with a CUDA context (and the memory they hold). A monitoring
agent that only calls nvmlInit holds /dev/nvidiactl and /dev/nvidiaN open but is in
no NVML list: only the fd scan finds it (seen on the device H200; the snapshot
tests/fixtures/facts/h200-foreign-agents.json replays it). Both are cheap (NVML queries
< 0.1 ms, the fd scan 3-4 ms over 130 fds there), so the daemon runs this every second.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, NamedTuple

from .facts import Roots


class Agent(NamedTuple):
    description: str
    fix: str
    names: tuple[str, ...]  # process names (comm, argv[0] or exe basename)
    cmdline: tuple[str, ...] = ()  # substrings of the command line


_METRICS = "zerod exports the GPU metrics itself (`zerod run`, /metrics)"

KNOWN_AGENTS: dict[str, Agent] = {
    "datadog-agent": Agent(
        "Datadog Agent: its NVML check polls every GPU on each collection",
        "disable its GPU check on inference hosts: `sudo rm /etc/datadog-agent/conf.d/nvml.d/conf.yaml"
        " && sudo systemctl restart datadog-agent` (or raise min_collection_interval); " + _METRICS,
        ("datadog-agent", "system-probe"), ("datadog-agent", "/opt/datadog")),
    "nv-hostengine": Agent(
        "NVIDIA DCGM host engine: watches GPU fields continuously",
        "`sudo systemctl disable --now nvidia-dcgm` on inference hosts, or watch fewer fields at a "
        "longer interval (dcgmi); " + _METRICS,
        ("nv-hostengine",)),
    "dcgm-exporter": Agent(
        "NVIDIA dcgm-exporter: Prometheus exporter that polls DCGM",
        "stop it on inference hosts (`kubectl delete ds dcgm-exporter` / `sudo systemctl disable --now "
        "dcgm-exporter`) or raise its interval (`-c 30000`); " + _METRICS,
        ("dcgm-exporter",)),
    "telegraf": Agent(
        "Telegraf: [[inputs.nvidia_smi]] runs nvidia-smi on every interval",
        "remove [[inputs.nvidia_smi]] from /etc/telegraf/telegraf.conf (or set interval = \"60s\") and "
        "`sudo systemctl restart telegraf`; " + _METRICS,
        ("telegraf",)),
    "nvidia-smi": Agent(
        "a nvidia-smi loop (watch nvidia-smi, nvidia-smi -l, nvidia-smi dmon)",
        "stop the loop (`pkill -f 'nvidia-smi -l'` / close the `watch`); use `zerod top` instead",
        ("nvidia-smi",)),
    "nvidia_gpu_exporter": Agent(
        "nvidia_gpu_exporter: runs nvidia-smi on every Prometheus scrape",
        "`sudo systemctl disable --now nvidia_gpu_exporter`; " + _METRICS,
        ("nvidia_gpu_exporter",)),
    "nvtop": Agent("nvtop: interactive GPU monitor", "close it; use `zerod top`", ("nvtop",)),
    "gpustat": Agent("gpustat: GPU monitor", "stop it (`gpustat -i` loops); use `zerod top`",
                     ("gpustat",), ("gpustat",)),
}

# Driver helpers that hold the devices by design: never foreign.
SYSTEM_PROCESSES = {
    "nvidia-persistenced": "the driver's persistence daemon",
    "nv-fabricmanager": "NVIDIA Fabric Manager (NVSwitch systems)",
    "nvidia-powerd": "the driver's power daemon",
}

# How zerod's own engine and daemon look from outside (another zerod process).
_ZEROD = re.compile(r"(^|[/\s])zerod(\s|$)|-m zerod|zerod\.engine|zerod\.service")


@dataclass
class GpuProcess:
    pid: int
    name: str = "?"  # /proc/PID/comm (15 characters at most)
    cmdline: str = ""
    exe: str | None = None
    user: str | None = None
    ppid: int | None = None
    ancestors: list[int] = field(default_factory=list)  # parent, grandparent, ... (not pid 1)
    gpus: list[int] = field(default_factory=list)
    gpu_memory_bytes: int | None = None  # from NVML; None when only the fd scan saw it
    unit: str | None = None  # systemd unit from /proc/PID/cgroup
    container: str | None = None  # "docker:0123abcd…", "kubepods:…", …
    source: str = "fd"  # "nvml" when NVML lists it (it holds a CUDA context), else "fd"
    devices: list[str] = field(default_factory=list)  # /dev/nvidia* it holds open
    visible: bool = True  # False: NVML lists a pid this /proc does not show (another pid namespace)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GpuProcess":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def names(self) -> set[str]:
        argv0 = self.cmdline.split(" ", 1)[0] if self.cmdline else ""
        return {n for n in (self.name, os.path.basename(argv0), os.path.basename(self.exe or "")) if n}


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def _stat_ppid(roots: Roots, pid: int) -> int | None:
    s = _read(roots.proc(f"{pid}/stat"))
    if not s:
        return None
    try:  # the name in parentheses may hold spaces: split after the last ')'
        return int(s.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return None


def _users(roots: Roots) -> dict[int, str]:
    out = {}
    for line in (_read(roots.root("etc/passwd"), 1 << 20) or "").splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[2].isdigit():
            out[int(parts[2])] = parts[0]
    return out


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """(systemd unit, container) from /proc/PID/cgroup."""
    unit = container = None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for part in path.split("/"):
            if part.endswith(".service") and not part.startswith("user@"):
                unit = part
            m = re.match(r"(docker|cri-containerd|crio|libpod)-([0-9a-f]{12,})\.scope$", part)
            if m:
                container = f"{m.group(1)}:{m.group(2)[:12]}"
        m = re.search(r"/(docker|kubepods)[/.].*?([0-9a-f]{64})", path)
        if m and container is None:
            container = f"{m.group(1)}:{m.group(2)[:12]}"
    return unit, container


def _nvml_processes() -> dict[int, dict]:
    """pid -> {gpus, mem} from NVML's compute and graphics lists (all GPUs)."""
    from .probe_nvml import session

    N = session()
    out: dict[int, dict] = {}
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        for fn in (N.nvmlDeviceGetComputeRunningProcesses, N.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                plist = fn(h)
            except N.NVMLError:
                continue
            for p in plist:
                e = out.setdefault(p.pid, {"gpus": [], "mem": None})
                if i not in e["gpus"]:
                    e["gpus"].append(i)
                mem = p.usedGpuMemory  # None when the driver hides it (no permission, MIG)
                if isinstance(mem, int) and mem < (1 << 60):
                    e["mem"] = (e["mem"] or 0) + mem
    return out


def _minor_to_index() -> dict[int, int]:
    from .probe_nvml import session

    N = session()
    out = {}
    for i in range(N.nvmlDeviceGetCount()):
        try:
            out[N.nvmlDeviceGetMinorNumber(N.nvmlDeviceGetHandleByIndex(i))] = i
        except N.NVMLError:
            pass
    return out


def fd_scan(roots: Roots, stats: dict | None = None) -> dict[int, set[str]]:
    """pid -> the /dev/nvidia* paths it holds open."""
    holders: dict[int, set[str]] = {}
    unreadable = scanned = 0
    try:
        pids = [int(p) for p in os.listdir(roots.procfs) if p.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        fddir = roots.proc(f"{pid}/fd")
        try:
            fds = os.listdir(fddir)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue  # the process ended
        scanned += 1
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fddir, fd))
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                holders.setdefault(pid, set()).add(target)
    if stats is not None:
        stats.update(processes=len(pids), scanned=scanned, unreadable=unreadable)
    return holders


def scan_gpu_processes(roots: Roots | None = None, nvml: bool = True,
                       stats: dict | None = None) -> list[GpuProcess]:
    """Every process holding an NVIDIA device, from NVML (nvml=True) and the fd scan.

    `stats` (optional) receives how many processes were scanned and how many could
    not be read (not root) and, when NVML failed, why.
    """
    roots = roots or Roots()
    stats = stats if stats is not None else {}
    nv: dict[int, dict] = {}
    minors: dict[int, int] = {}
    if nvml:
        try:
            nv = _nvml_processes()
            minors = _minor_to_index()
        except Exception as exc:  # NVML missing here: the fd scan still runs
            stats["nvml_error"] = str(exc)
    holders = fd_scan(roots, stats)
    users = _users(roots) if (nv or holders) else {}
    out = []
    for pid in sorted(set(nv) | set(holders)):
        p = GpuProcess(pid=pid)
        devs = sorted(holders.get(pid, ()))
        p.devices = devs
        for d in devs:
            m = re.fullmatch(r"/dev/nvidia(\d+)", d)
            if m:
                idx = minors.get(int(m.group(1)), int(m.group(1)))
                if idx not in p.gpus:
                    p.gpus.append(idx)
        if pid in nv:
            p.source = "nvml"
            p.gpu_memory_bytes = nv[pid]["mem"]
            p.gpus = sorted(set(p.gpus) | set(nv[pid]["gpus"]))
        comm = _read(roots.proc(f"{pid}/comm"))
        if comm is None:
            p.visible = False
            p.name = "?"
            out.append(p)
            continue
        p.name = comm.strip()
        p.cmdline = (_read(roots.proc(f"{pid}/cmdline"), 8192) or "").replace("\0", " ").strip()
        try:
            p.exe = os.readlink(roots.proc(f"{pid}/exe"))
        except OSError:
            pass
        status = _read(roots.proc(f"{pid}/status")) or ""
        m = re.search(r"^Uid:\s+(\d+)", status, re.M)
        if m:
            uid = int(m.group(1))
            p.user = users.get(uid, str(uid))
        p.ppid = _stat_ppid(roots, pid)
        q, seen = p.ppid, 0
        while q and q > 1 and seen < 32:  # the chain up to init: zerod's children are its own
            p.ancestors.append(q)
            q, seen = _stat_ppid(roots, q), seen + 1
        p.unit, p.container = parse_cgroup(_read(roots.proc(f"{pid}/cgroup")) or "")
        out.append(p)
    return out


def match_agent(proc: GpuProcess) -> str | None:
    names = proc.names()
    for key, agent in KNOWN_AGENTS.items():
        for n in agent.names:
            # comm is cut to 15 characters by the kernel
            if n in names or n[:15] in names or (proc.unit or "").startswith(n):
                return key
        if any(s in proc.cmdline for s in agent.cmdline):
            return key
    return None


def classify(proc: GpuProcess, own_pids: Iterable[int] = (), allowed: Iterable[str] = ()) -> tuple[str, str]:
    """(role, why). Roles: self (zerod, this process or its children), engine (another
    zerod process: the daemon or its engine), system (driver helpers), allowed (the
    config allows it), agent (a known monitoring agent: foreign), foreign."""
    own = set(own_pids)
    if proc.pid in own:
        return "self", "zerod itself"
    if own & set(proc.ancestors):
        return "self", "a child of zerod (its engine)"
    names = proc.names()
    for n, what in SYSTEM_PROCESSES.items():
        if n in names or n[:15] in names:
            return "system", what
    if _ZEROD.search(proc.cmdline) or proc.unit == "zerod.service":
        return "engine", "a zerod daemon or engine process"
    for pat in allowed:
        for cand in (*names, proc.cmdline, proc.unit or "", proc.container or ""):
            if cand and fnmatch.fnmatch(cand, pat):
                return "allowed", f"allowed by [doctor] allowed_gpu_processes ({pat!r})"
    agent = match_agent(proc)
    if agent:
        return "agent", KNOWN_AGENTS[agent].description
    if not proc.visible:
        return "foreign", "NVML lists this pid but it is not in this /proc (another pid namespace?)"
    return "foreign", "not zerod and not allowed by the config"


def is_foreign(role: str) -> bool:
    return role in ("agent", "foreign")


def holds_context(proc: GpuProcess) -> bool:
    """In NVML's compute/graphics lists (a CUDA context) or holding GPU memory.

    The device nodes cannot tell: on the H200 an nvmlInit-only process and one with a
    CUDA context held the same set (/dev/nvidiactl, /dev/nvidia0, /dev/nvidia-uvm,
    /dev/nvidia-caps/*). NVML's process lists can: only a context is in them."""
    return proc.source == "nvml" or bool(proc.gpu_memory_bytes)


def foreign_severity(proc: GpuProcess, nvml_lists: bool = True) -> str:
    """"fail" for a foreign process that holds a CUDA context or GPU memory (it takes
    memory and SM time from the engine), "warn" for one that only reads NVML: an
    NVML-only agent polling at 10 Hz and ~94 Hz left the engine's ITL unchanged on the
    H200 (docs/checks.md). `nvml_lists=False` (NVML's process lists could not be read):
    an fd-only holder may hold a context unseen, so it fails too."""
    if holds_context(proc) or not nvml_lists:
        return "fail"
    return "warn"


def describe(proc: GpuProcess) -> str:
    """One line naming the process for a person: pid, name, user, unit/container, memory."""
    bits = [f"pid {proc.pid} {proc.name}"]
    if proc.user:
        bits.append(f"user {proc.user}")
    if proc.unit:
        bits.append(f"unit {proc.unit}")
    if proc.container:
        bits.append(f"container {proc.container}")
    if proc.gpu_memory_bytes is not None:
        bits.append(f"{proc.gpu_memory_bytes / 2**30:.1f} GiB on GPU {','.join(map(str, proc.gpus))}")
    elif proc.source == "nvml":
        bits.append(f"a CUDA context on GPU {','.join(map(str, proc.gpus)) or '?'} (memory not reported)")
    else:
        bits.append(f"holds {', '.join(proc.devices) or 'the GPU'} (fd scan; no CUDA context)")
    cmd = proc.cmdline if len(proc.cmdline) <= 60 else proc.cmdline[:57] + "..."
    if cmd:
        bits.append(f"cmd: {cmd}")
    return ", ".join(bits)
