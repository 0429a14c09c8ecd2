"""`zerod doctor` as a user runs it: exit codes, the JSON object, the text in 80 columns
without colour, re-rooting on a fake host tree, --facts/--save-facts, --config, and
never a traceback."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_checks_gpu_processes import make_proc
from test_checks_helpers import FACTS_DIR, REPO, cli_env, dump, edit_gpu0, h200

from zerod.cli import cli
from zerod.checks import CATALOGUE

STATUSES = {"pass", "warn", "fail", "skip", "error"}


def doctor(*args, config=None):
    base = ["doctor"]
    if config is None:
        config = os.devnull  # never the machine's /etc/zerod/zerod.toml
    if config:
        base += ["--config", str(config)]
    return CliRunner().invoke(cli, base + list(args))


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "zerod", "doctor", *args], capture_output=True, text=True,
                          cwd=REPO, env=cli_env(), timeout=60, **kw)


# -- on this machine (no NVIDIA driver) --------------------------------------------------------

def test_this_machine_without_driver_fails_gpu_checks_and_exits_2():
    p = run("--json")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    d = json.loads(p.stdout)
    by = {c["id"]: c for c in d["checks"]}
    assert [c["id"] for c in d["checks"]] == list(CATALOGUE)
    for cid in CATALOGUE:
        if cid.startswith("gpu."):
            assert by[cid]["status"] == "fail" and "no NVIDIA driver found" in by[cid]["message"]
            assert "install the NVIDIA" in by[cid]["remediation"]
    # the host checks still ran
    assert by["kernel.version"]["status"] in ("pass", "warn")
    assert by["kernel.numa_balancing"]["status"] in ("pass", "fail", "skip")


def test_json_schema():
    p = run("--json")
    d = json.loads(p.stdout)
    assert set(d) == {"version", "host", "checks", "summary"}
    assert d["version"] and d["host"]["hostname"]
    for c in d["checks"]:
        assert {"id", "title", "status", "severity", "evidence", "remediation"} <= set(c)
        assert c["status"] in STATUSES and c["severity"] in ("critical", "major", "minor")
        assert isinstance(c["evidence"], list) and isinstance(c["remediation"], str)
        for e in c["evidence"]:
            assert {"name", "value", "source"} <= set(e)
    s = d["summary"]
    assert sum(s[k] for k in STATUSES) == s["total"] == len(d["checks"]) and s["exit_code"] == 2


def test_doctor_never_imports_torch_nor_creates_a_cuda_context():
    code = ("import sys\nsys.argv = ['zerod', 'doctor', '--json', '--config', '/dev/null']\n"
            "from zerod.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'zerod.tui', 'textual', 'pyroute2') if m in sys.modules]\n"
            # the engine's torch-free model spec (and the config it reads) only
            "bad += [m for m in sys.modules if m.startswith('zerod.engine.')\n"
            "        and m != 'zerod.engine.config' and not m.startswith('zerod.engine.spec')]\n"
            "assert not bad, bad\nprint('clean', file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=cli_env(), timeout=60)
    assert "clean" in p.stderr, p.stderr


def test_human_output_grouped_80_columns_no_colour():
    r = doctor()
    assert r.exit_code == 2
    out = r.output
    assert "\x1b[" not in out  # not a terminal: no colour codes
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    for area in ("GPU", "Kernel", "NUMA", "Host", "Memory", "CPU", "Network", "Engine"):
        assert f"\n{area}\n" in out
    assert re.search(r"FAIL gpu\.driver_loaded +no NVIDIA driver found", out)
    assert "fix: install the NVIDIA" in out
    assert re.search(r"34 checks: \d+ ok, \d+ warn, \d+ fail, \d+ skipped, \d+ errors -> exit 2", out)


def test_exit_codes_from_snapshots(tmp_path):
    assert doctor("--facts", str(FACTS_DIR / "h200.json")).exit_code == 0
    assert doctor("--facts", str(FACTS_DIR / "host-limits.json")).exit_code == 1
    assert doctor("--facts", str(FACTS_DIR / "v100.json")).exit_code == 2
    # only/skip narrow the run and so the exit code
    assert doctor("--facts", str(FACTS_DIR / "v100.json"), "--skip", "gpu").exit_code == 0
    assert doctor("--facts", str(FACTS_DIR / "v100.json"), "--only", "gpu.compute_capability",
                  "--only", "kernel").exit_code == 2


def test_every_snapshot_renders_within_80_columns():
    for path in sorted(FACTS_DIR.glob("*.json")):
        out = doctor("--facts", str(path), "-v").output
        assert all(len(line) <= 80 for line in out.splitlines()), (path.name, max(out.splitlines(), key=len))
        assert "Traceback" not in out


def test_verbose_shows_evidence():
    r = doctor("--facts", str(FACTS_DIR / "h200.json"), "--only", "kernel.numa_balancing", "-v")
    assert "kernel.numa_balancing = 0 (/proc/sys/kernel/numa_balancing)" in r.output


def test_facts_round_trip(tmp_path):
    """A snapshot saved on one host replays to the same report elsewhere."""
    saved = tmp_path / "facts.json"
    p = run("--json", "--save-facts", str(saved))
    live = json.loads(p.stdout)
    p2 = run("--json", "--facts", str(saved))
    replay = json.loads(p2.stdout)
    assert p.returncode == p2.returncode
    strip = lambda d: [(c["id"], c["status"], c["message"]) for c in d["checks"]]  # noqa: E731
    assert strip(live) == strip(replay)
    # and a snapshot taken on the H200 replays here with the H200's verdict
    again = tmp_path / "again.json"
    r = doctor("--facts", str(FACTS_DIR / "h200.json"), "--save-facts", str(again), "--json")
    assert r.exit_code == 0
    assert json.loads(again.read_text())["facts"] == json.loads((FACTS_DIR / "h200.json").read_text())["facts"]


def test_config_file_waivers_and_allowed_processes(tmp_path):
    cfg = tmp_path / "zerod.toml"
    cfg.write_text('[doctor]\nallowed_gpu_processes = ["dcgm-exporter", "datadog-agent", "docker:*"]\n'
                   'gpu_memory_utilization = 0.6\n'
                   '[doctor.waivers]\n"kernel.numa_balancing" = "lab box"\n"numa.gpu_affinity" = "lab box"\n')
    assert doctor("--facts", str(FACTS_DIR / "foreign-agent.json")).exit_code == 2
    assert doctor("--facts", str(FACTS_DIR / "foreign-agent.json"), config=cfg).exit_code == 0
    r = doctor("--facts", str(FACTS_DIR / "numa-balancing.json"), "--json", config=cfg)
    d = json.loads(r.output)
    assert r.exit_code == 0 and d["summary"]["waived"]["kernel.numa_balancing"] == "lab box"


def test_public_bind_without_api_key_from_config(tmp_path):
    cfg = tmp_path / "zerod.toml"
    cfg.write_text('[engine]\nhost = "0.0.0.0"\n')
    r = doctor("--facts", str(FACTS_DIR / "host-limits.json"), "--only", "net", config=cfg)
    assert r.exit_code == 2 and "34.120.10.5" in r.output
    cfg.write_text('[engine]\nhost = "0.0.0.0"\napi_key = "s3cret"\n')
    assert doctor("--facts", str(FACTS_DIR / "host-limits.json"), "--only", "net", config=cfg).exit_code == 0


@pytest.mark.parametrize("text,words", [
    ("[doctor]\nmax_memory_fractoin = 0.9\n", "unknown key"),
    ("[doctor\n", "not valid TOML"),
    ("[nope]\n", "unknown section"),
])
def test_bad_config_is_a_usage_error(tmp_path, text, words):
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(text)
    r = doctor("--facts", str(FACTS_DIR / "h200.json"), config=cfg)
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output


def test_bad_inputs_never_print_a_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    p = run("--facts", str(bad))
    assert p.returncode == 2 and "cannot read facts snapshot" in p.stderr and "Traceback" not in p.stderr
    p = run("--only", "gpu.nope")
    assert p.returncode == 64 and "no check matches" in p.stderr and "Traceback" not in p.stderr
    # a snapshot whose values make a check raise: that check errors, the rest report
    broken = dump(edit_gpu0(h200(), cc="garbage", memory="garbage"), tmp_path / "broken.json")
    p = run("--facts", broken, "--json")
    d = json.loads(p.stdout)
    errs = {c["id"] for c in d["checks"] if c["status"] == "error"}
    assert errs == {"gpu.compute_capability", "gpu.memory_headroom"}
    assert p.returncode == 1 and "Traceback" not in p.stderr + p.stdout


@pytest.mark.parametrize("option,typo,closest", [
    ("--only", "no.such.check", None),
    ("--only", "gpu.clock_event", "gpu.clock_events"),
    ("--skip", "kernal", "kernel"),
    ("--only", "kernel,numa_balancing", "kernel.numa_balancing"),
])
def test_unknown_check_id_is_exit_64_naming_the_closest(option, typo, closest):
    """A typo in --only/--skip is a usage error (EX_USAGE), never "a check failed" (2)."""
    p = run("--facts", str(FACTS_DIR / "v100.json"), option, typo)  # v100 alone would exit 2
    assert p.returncode == 64, p.stderr
    assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr
    bad = typo.split(",")[-1]
    assert p.stderr.startswith(f"zerod doctor: no check matches {bad!r}; closest: ")
    named = p.stderr.split("closest: ", 1)[1].split(" (", 1)[0].split(", ")
    assert len(named) == 3 and set(named) <= set(CATALOGUE) | {i.split(".")[0] for i in CATALOGUE}
    if closest:
        assert named[0] == closest


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="drops to an unprivileged user with setpriv, which needs root")


@needs_root
def test_unreadable_default_config_is_said_and_defaults_are_used():
    """`zerod install` writes the config 0640: an operator without rights still gets a report."""
    root = Path(tempfile.mkdtemp(prefix="zerod-doctor-"))
    try:
        fake_tree(root)
        (root / "etc/zerod").mkdir(parents=True)
        (root / "etc/zerod/zerod.toml").write_text("[engine]\napi_key = 'secret'\n")
        for dirpath, _, files in os.walk(root):
            os.chmod(dirpath, 0o755)
            for f in files:
                if not os.path.islink(os.path.join(dirpath, f)):
                    os.chmod(os.path.join(dirpath, f), 0o644)
        os.chmod(root / "etc/zerod/zerod.toml", 0o640)
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                            "-m", "zerod", "doctor", "--rootfs", str(root), "--only", "kernel.version"],
                           capture_output=True, text=True, cwd=REPO, timeout=60,
                           env={**cli_env(), "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"})
        assert p.returncode == 2, p.stderr  # kernel 5.4 fails: the report ran
        assert f"cannot read {root}/etc/zerod/zerod.toml (permission denied)" in p.stderr
        assert "default settings" in p.stderr and "Traceback" not in p.stderr
        assert "kernel.version" in p.stdout
    finally:
        shutil.rmtree(root)


# -- re-rooting: a fake host tree ------------------------------------------------------------

def fake_tree(root):
    """A host with a 5.4 kernel, NUMA balancing on, nouveau bound, THP always, powersave,
    memlock 64 KiB, an Xid in the kernel log and a monitoring agent holding the GPU."""
    w = lambda rel, text: (root / rel).parent.mkdir(parents=True, exist_ok=True) or (root / rel).write_text(text)  # noqa: E731
    w("proc/sys/kernel/osrelease", "5.4.0-42-generic\n")
    w("proc/sys/kernel/hostname", "gpu-node-7\n")
    w("proc/sys/kernel/numa_balancing", "1\n")
    w("proc/modules", "nouveau 2170880 0 - Live 0x0\ndrm 491520 3 nouveau, Live 0x0\n")
    w("proc/self/limits", "Limit Soft Limit Hard Limit Units\nMax locked memory 65536 65536 bytes\n")
    w("proc/self/status", "Name:\tzerod\nCpus_allowed_list:\t0-31\nMems_allowed_list:\t0-1\n")
    w("proc/uptime", "5000.00 9000.00\n")
    w("boot/config-5.4.0-42-generic", "CONFIG_IO_URING=y\n# CONFIG_NUMA_BALANCING is not set\n")
    w("dev/kmsg", "6,1,4000000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, name=, GPU has fallen off the bus.\n")
    w("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n")
    w("sys/kernel/mm/transparent_hugepage/defrag", "always defer defer+madvise [madvise] never\n")
    for cpu in range(2):
        w(f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", "powersave\n")
    w("sys/devices/system/node/node0/cpulist", "0-15\n")
    w("sys/devices/system/node/node1/cpulist", "16-31\n")
    dev = "sys/bus/pci/devices/0000:3b:00.0"
    for name, text in {"vendor": "0x10de", "class": "0x030200", "device": "0x20b5", "numa_node": "1",
                       "local_cpulist": "16-31", "current_link_width": "16", "max_link_width": "16"}.items():
        w(f"{dev}/{name}", text + "\n")
    (root / "sys/bus/pci/drivers/nouveau").mkdir(parents=True)
    os.symlink("../../../bus/pci/drivers/nouveau", root / dev / "driver")
    w("etc/passwd", "root:x:0:0::/root:/bin/sh\n")
    make_proc(root, 4242, "nv-hostengine", "/usr/bin/nv-hostengine -n --service-account nvidia-dcgm",
              ["/dev/nvidiactl", "/dev/nvidia0"], cgroup="0::/system.slice/nvidia-dcgm.service\n")


def test_rerooted_fake_tree(tmp_path):
    fake_tree(tmp_path)
    saved = tmp_path / "facts.json"
    r = doctor("--procfs", str(tmp_path / "proc"), "--sysfs", str(tmp_path / "sys"), "--rootfs", str(tmp_path),
               "--json", "--save-facts", str(saved))
    d = json.loads(r.output)
    by = {c["id"]: c for c in d["checks"]}
    assert d["host"]["hostname"] == "gpu-node-7" and d["host"]["kernel"] == "5.4.0-42-generic"
    assert by["kernel.version"]["status"] == "fail"
    assert by["kernel.io_uring"]["status"] == "pass"  # from /boot/config-5.4.0-42-generic
    assert by["kernel.numa_balancing"]["status"] == "fail"
    assert by["mem.memlock"]["status"] == "warn" and "limited to 64 KiB" in by["mem.memlock"]["message"]
    assert by["mem.transparent_hugepages"]["status"] == "warn"
    assert by["cpu.governor"]["status"] == "warn" and "powersave on 2 CPU(s)" in by["cpu.governor"]["message"]
    assert "nouveau is bound to 0000:3b:00.0" in by["gpu.driver_loaded"]["message"]
    assert by["numa.gpu_affinity"]["status"] == "pass"  # node 1 is within zerod's CPUs and memory
    assert r.exit_code == 2
    facts = json.loads(saved.read_text())["facts"]
    assert facts["kernel.numa_balancing"]["source"] == str(tmp_path / "proc/sys/kernel/numa_balancing")
    (agent,) = facts["gpu.processes"]["value"]
    assert (agent["pid"], agent["name"], agent["unit"]) == (4242, "nv-hostengine", "nvidia-dcgm.service")
    assert facts["kernel.xid_events"]["value"]["events"][0]["xid"] == 79
    # replayed with a driver (edited in), the agent and the Xid are named
    f = h200()
    for key in ("gpu.processes", "kernel.xid_events"):
        f.items[key] = facts[key]
    f.put("self.pids", [], "test")
    out = " ".join(doctor("--facts", dump(f, tmp_path / "x.json"), "--only", "gpu.foreign_processes",
                          "--only", "gpu.xid_recent").output.split())
    assert "NVIDIA DCGM host engine" in out and "pid 4242 nv-hostengine" in out
    assert "nvidia-dcgm" in out and "Xid 79" in out


def test_rootfs_alone_reroots_proc_and_sys(tmp_path):
    fake_tree(tmp_path)
    r = doctor("--rootfs", str(tmp_path), "--json", "--only", "kernel", "--only", "cpu")
    by = {c["id"]: c["status"] for c in json.loads(r.output)["checks"]}
    assert by == {"kernel.version": "fail", "kernel.io_uring": "pass", "kernel.numa_balancing": "fail",
                  "cpu.governor": "warn"}


def test_missing_and_unreadable_host_files(tmp_path):
    fake_tree(tmp_path)
    os.unlink(tmp_path / "proc/sys/kernel/numa_balancing")  # a kernel without it: skip
    (tmp_path / "proc/self/limits").unlink()
    (tmp_path / "proc/self/limits").mkdir()  # unreadable as a file: error, with the reason
    r = doctor("--rootfs", str(tmp_path), "--json", "--only", "kernel.numa_balancing", "--only", "mem.memlock")
    by = {c["id"]: c for c in json.loads(r.output)["checks"]}
    assert by["kernel.numa_balancing"]["status"] == "skip"
    assert "does not exist" in by["kernel.numa_balancing"]["message"]
    assert by["mem.memlock"]["status"] == "error" and "limits" in by["mem.memlock"]["message"]
    assert r.exit_code == 1


def test_kernel_config_from_proc_config_gz(tmp_path):
    fake_tree(tmp_path)
    with gzip.open(tmp_path / "proc/config.gz", "wt") as f:
        f.write("# CONFIG_IO_URING is not set\n")
    r = doctor("--rootfs", str(tmp_path), "--json", "--only", "kernel.io_uring")
    (c,) = json.loads(r.output)["checks"]
    # read from /proc/config.gz; io_uring not built is reported, not failed (zerod uses none)
    assert c["status"] == "pass" and "CONFIG_IO_URING=n" in c["message"]
