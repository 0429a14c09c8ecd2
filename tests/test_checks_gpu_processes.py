"""Foreign GPU processes: the /proc/*/fd scan on a fake /proc tree, NVML rows as recorded
on the device H200, known agents named with their fix, zerod recognising itself."""

from __future__ import annotations

import os
import time

from test_checks_helpers import h200, load, result

from zerod.checks import DoctorConfig, Roots, run_checks
from zerod.checks.gpu_processes import (
    KNOWN_AGENTS, GpuProcess, classify, is_foreign, parse_cgroup, scan_gpu_processes)


def make_proc(root, pid, comm, cmdline, devs=(), ppid=1, uid=0, cgroup="0::/user.slice\n"):
    d = root / "proc" / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline.split()) + b"\0")
    (d / "status").write_text(f"Name:\t{comm}\nPid:\t{pid}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (d / "cgroup").write_text(cgroup)
    os.symlink("/dev/null", d / "fd" / "0")
    os.symlink("socket:[1234]", d / "fd" / "1")
    for i, dev in enumerate(devs, start=3):
        os.symlink(dev, d / "fd" / str(i))


def fake_host(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\ndd-agent:x:998:998::/opt:/bin/false\n"
                                             "alice:x:1000:1000::/home/alice:/bin/bash\n")
    ctl = ["/dev/nvidiactl", "/dev/nvidia0"]
    make_proc(tmp_path, 1, "systemd", "/sbin/init")
    make_proc(tmp_path, 100, "zerod", "/usr/bin/python3 /usr/bin/zerod run", ctl, 1, 0,
              "0::/system.slice/zerod.service\n")
    make_proc(tmp_path, 101, "python3", "/usr/bin/python3 -m zerod.engine serve --model /m", ctl + ["/dev/nvidia-uvm"],
              100, 0, "0::/system.slice/zerod.service\n")
    make_proc(tmp_path, 200, "datadog-agent", "/opt/datadog-agent/bin/agent/agent run", ctl, 1, 998,
              "0::/system.slice/datadog-agent.service\n")
    make_proc(tmp_path, 300, "nvidia-persiste", "/usr/bin/nvidia-persistenced --user nvidia-persistenced", ctl)
    make_proc(tmp_path, 400, "python3", "python3 train.py", ["/dev/nvidia1", "/dev/nvidiactl"], 1, 1000,
              "0::/system.slice/docker-4f1c2a9e0b7d5a6c8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d.scope\n")
    make_proc(tmp_path, 500, "bash", "bash")  # no GPU fds: not listed
    return Roots.make(rootfs=str(tmp_path))


def test_fd_scan_finds_every_holder_with_its_details(tmp_path):
    roots = fake_host(tmp_path)
    stats: dict = {}
    procs = {p.pid: p for p in scan_gpu_processes(roots, nvml=False, stats=stats)}
    assert set(procs) == {100, 101, 200, 300, 400}
    assert stats["scanned"] == 7 and stats["unreadable"] == 0
    dd = procs[200]
    assert (dd.name, dd.user, dd.unit, dd.source, dd.gpus) == ("datadog-agent", "dd-agent",
                                                               "datadog-agent.service", "fd", [0])
    assert dd.gpu_memory_bytes is None and "/dev/nvidiactl" in dd.devices
    job = procs[400]
    assert (job.user, job.container, job.gpus) == ("alice", "docker:4f1c2a9e0b7d", [1])
    assert procs[101].ancestors == [100]


def test_classify_roles(tmp_path):
    procs = {p.pid: p for p in scan_gpu_processes(fake_host(tmp_path), nvml=False)}
    own = [100]  # the daemon's own pid; 101 is its engine child
    roles = {pid: classify(p, own, ())[0] for pid, p in procs.items()}
    assert roles == {100: "self", 101: "self", 200: "agent", 300: "system", 400: "foreign"}
    # Seen from another process (zerod doctor run by hand), the daemon and its engine are zerod's.
    assert classify(procs[100], [], ())[0] == "engine" and classify(procs[101], [], ())[0] == "engine"
    # The config can allow a process by name, unit or container.
    assert classify(procs[400], [], ("docker:4f1c*",))[0] == "allowed"
    assert classify(procs[200], [], ("datadog-agent.service",))[0] == "allowed"
    assert not is_foreign("allowed") and is_foreign("agent")


def test_known_agents_by_comm_argv0_and_cmdline():
    def role(**kw):
        return classify(GpuProcess(pid=9, **kw), [], ())

    assert role(name="nv-hostengine", cmdline="nv-hostengine -n")[0] == "agent"
    assert role(name="python3", cmdline="dcgm-exporter -c 1000")[0] == "agent"  # exec -a
    assert role(name="telegraf", cmdline="/usr/bin/telegraf -config x")[0] == "agent"
    assert role(name="nvidia-smi", cmdline="nvidia-smi -l 1")[0] == "agent"
    assert role(name="nvidia_gpu_expo", cmdline="")[0] == "agent"  # comm cut to 15 characters
    for key, agent in KNOWN_AGENTS.items():
        assert agent.description and agent.fix, key


def test_parse_cgroup():
    assert parse_cgroup("0::/system.slice/telegraf.service\n") == ("telegraf.service", None)
    assert parse_cgroup("0::/user.slice/user-1000.slice/user@1000.service/app.slice/nvtop.service\n") == (
        "nvtop.service", None)
    cid = "a" * 64
    assert parse_cgroup(f"0::/kubepods/burstable/pod1234/{cid}\n") == (None, "kubepods:aaaaaaaaaaaa")
    assert parse_cgroup(f"0::/system.slice/cri-containerd-{cid}.scope\n")[1] == "cri-containerd:aaaaaaaaaaaa"


def test_scan_of_the_real_proc_is_cheap_and_finds_nothing_here():
    scan_gpu_processes(nvml=False)
    t = time.perf_counter()
    for _ in range(10):
        procs = scan_gpu_processes(nvml=False)
    ms = (time.perf_counter() - t) * 100
    assert procs == []  # no NVIDIA devices on this machine
    assert ms < 100, f"{ms:.1f} ms per scan"  # 2-3 ms on the H200; generous for a busy CI box


def test_foreign_agent_snapshot_names_agents_and_fixes():
    r = result(load("foreign-agent"), "gpu.foreign_processes")
    # severity from evidence: two hold a CUDA context and memory (fail), one only reads NVML
    assert r.status == "fail" and "2 foreign process(es) with a CUDA context or GPU memory" in r.message
    assert "1 process(es) only read NVML" in r.message
    assert "pid 488 dcgm-exporter" in r.message and "2.5 GiB on GPU 0" in r.message
    assert "pid 501 datadog-agent" in r.message and "fd scan; no CUDA context" in r.message
    assert "unit datadog-agent.service" in r.message and "container docker:4f1c2a9e0b7d" in r.message
    assert "conf.d/nvml.d" in r.remediation  # the Datadog fix
    assert "dcgm-exporter" in r.remediation and "allowed_gpu_processes" in r.remediation
    roles = {e["name"]: e["value"]["role"] for e in r.evidence}
    assert roles["pid 419"] == "self"  # the doctor process that took the H200 snapshot
    levels = {e["name"]: e["value"]["severity"] for e in r.evidence}
    assert levels == {"pid 419": None, "pid 488": "fail", "pid 501": "warn", "pid 733": "fail"}


def _only(facts, *pids):
    from test_checks_helpers import edit

    return edit(facts, "gpu.processes", [p for p in facts.value("gpu.processes") if p["pid"] in pids])


def test_an_nvml_only_agent_warns_and_cites_the_measurement():
    f = _only(load("foreign-agent"), 419, 501)  # doctor itself and datadog-agent (fd scan only)
    r = result(f, "gpu.foreign_processes")
    assert r.status == "warn", r.message
    assert "pid 501 datadog-agent" in r.message and "no CUDA context" in r.message
    assert "p50 5.32 ms" in r.message and "conf.d/nvml.d" in r.remediation


def test_a_cuda_context_without_reported_memory_still_fails():
    f = _only(load("foreign-agent"), 488)
    procs = f.value("gpu.processes")
    procs[0]["gpu_memory_bytes"] = None  # the driver hides it (a container, MIG)
    r = result(f, "gpu.foreign_processes")
    assert r.status == "fail" and "a CUDA context on GPU 0 (memory not reported)" in r.message


def test_without_nvml_process_lists_an_fd_holder_cannot_be_cleared():
    from test_checks_helpers import edit

    f = _only(load("foreign-agent"), 501)
    f = edit(f, "gpu.process_scan", {"processes": 9, "scanned": 9, "unreadable": 0,
                                     "nvml_error": "Insufficient Permissions"})
    r = result(f, "gpu.foreign_processes")
    assert r.status == "fail" and "NVML's process lists could not be read" in r.message


def test_foreign_severity_for_the_daemon():
    from zerod.checks.gpu_processes import foreign_severity, holds_context

    reader = GpuProcess(pid=5, source="fd", devices=["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"])
    job = GpuProcess(pid=6, source="nvml", gpu_memory_bytes=16 << 30)
    assert not holds_context(reader) and holds_context(job)
    assert foreign_severity(reader) == "warn" and foreign_severity(job) == "fail"
    assert foreign_severity(reader, nvml_lists=False) == "fail"


def test_allowed_processes_from_config_pass():
    cfg = DoctorConfig.from_dict({"allowed_gpu_processes": ["dcgm-exporter", "datadog-agent*", "docker:4f1c*"]})
    r = result(load("foreign-agent"), "gpu.foreign_processes", cfg)
    assert r.status == "pass", r.message


def test_the_engine_own_memory_counts_as_free_for_headroom():
    # zerod's engine holding 120 GiB must not make doctor (run beside it) fail the headroom check
    import copy

    f = h200()
    procs = copy.deepcopy(f.value("gpu.processes"))
    procs.append({"pid": 777, "name": "python3", "cmdline": "python3 -m zerod serve --model /m", "gpus": [0],
                  "gpu_memory_bytes": 120 << 30, "source": "nvml", "devices": ["/dev/nvidia0"]})
    f.put("gpu.processes", procs, "test")
    g = copy.deepcopy(f.value("nvml.gpus"))
    g[0]["memory"] = {"total": 150754820096, "free": 150754820096 - (121 << 30), "used": 121 << 30}
    f.put("nvml.gpus", g, "test")
    by = {c.id: c.status for c in run_checks(f).checks}
    assert by["gpu.foreign_processes"] == "pass" and by["gpu.memory_headroom"] == "pass"
