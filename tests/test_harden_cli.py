"""`zerod harden` in a temporary root: the dry-run plan, --apply, --rollback, a failure
half-way that leaves nothing applied, and the refusal without rights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_checks_helpers import REPO, cli_env, edit_gpu0, h200

from zerod.cli import cli
from zerod.checks import harden as H


def host(root: Path) -> Path:
    w = lambda rel, text: (root / rel).parent.mkdir(parents=True, exist_ok=True) or (root / rel).write_text(text)  # noqa: E731
    w("proc/sys/kernel/numa_balancing", "1\n")
    w("proc/sys/kernel/io_uring_disabled", "0\n")
    w("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n")
    w("sys/kernel/mm/transparent_hugepage/defrag", "always defer defer+madvise [madvise] never\n")
    for cpu in range(3):
        w(f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", "powersave\n")
    (root / "etc").mkdir(exist_ok=True)
    return root


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = p.read_text() if p.is_file() else "?"
    return out


def harden(*args):
    return CliRunner().invoke(cli, ["harden", *args])


def thp(root: Path) -> str:
    return H.selected((root / "sys/kernel/mm/transparent_hugepage/enabled").read_text())


def test_plan_is_a_dry_run(tmp_path):
    root = host(tmp_path)
    before = snapshot(root)
    r = harden("--rootfs", str(root))
    assert r.exit_code == 0, r.output
    out = r.output
    assert "kernel.numa_balancing: 1 -> 0" in out
    assert "THP enabled: always -> madvise" in out
    assert "CPU governor (3 CPUs): powersave -> performance" in out
    assert "sysctl drop-in: create" in out and "| kernel.numa_balancing = 0" in out
    assert "zerod.service memlock: create" in out and "| LimitMEMLOCK=infinity" in out
    assert "zerod never changes them" in out  # GPU clocks and power limits
    assert "io_uring_disabled: " not in out  # already 0: nothing to change
    assert snapshot(root) == before


def test_apply_then_rollback(tmp_path):
    root = host(tmp_path)
    before = snapshot(root)
    r = harden("--apply", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert "applied:" in r.output and "--rollback" in r.output
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "0"
    assert thp(root) == "madvise"
    assert {(root / f"sys/devices/system/cpu/cpu{i}/cpufreq/scaling_governor").read_text().strip()
            for i in range(3)} == {"performance"}
    assert (root / H.SYSCTL_DROPIN).read_text() == H.sysctl_dropin_text()
    assert "LimitMEMLOCK=infinity" in (root / H.MEMLOCK_DROPIN).read_text()
    tmpfiles = (root / H.TMPFILES_DROPIN).read_text()
    assert "transparent_hugepage/enabled - - - - madvise" in tmpfiles and "scaling_governor - - - - performance" in tmpfiles
    assert (root / H.STATE_FILE).exists()
    # applied: the plan is now empty, and a second apply changes nothing
    assert "nothing to change" in harden("--rootfs", str(root)).output
    assert "nothing to apply" in harden("--apply", "--rootfs", str(root)).output

    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert "restored" in r.output and "removed" in r.output
    after = snapshot(root)
    assert after["proc/sys/kernel/numa_balancing"].strip() == "1"
    assert thp(root) == "always"
    assert all(after[k].strip() == "powersave" for k in after if k.endswith("scaling_governor"))
    assert set(after) == set(before)  # the drop-ins and the state file are gone
    assert "nothing to roll back" in harden("--rollback", "--rootfs", str(root)).output


def test_failure_half_way_rolls_back_everything(tmp_path):
    root = host(tmp_path)
    # The last step (the memlock drop-in) cannot be written: a folder stands where the file goes.
    (root / H.MEMLOCK_DROPIN).mkdir(parents=True)
    before = snapshot(root)
    dirs_before = sorted(p for p, _, _ in os.walk(root))
    r = harden("--apply", "--rootfs", str(root))
    assert r.exit_code == 1
    assert "applying failed" in r.output and "every change was rolled back" in r.output
    assert snapshot(root) == {k: v for k, v in before.items()} | {
        "sys/kernel/mm/transparent_hugepage/enabled": "always\n"}  # restored as the kernel takes it
    assert thp(root) == "always"
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "1"
    assert not (root / H.STATE_FILE).exists()
    assert sorted(p for p, _, _ in os.walk(root)) == dirs_before  # created folders removed too


def test_apply_and_rollback_together_is_a_usage_error(tmp_path):
    r = harden("--apply", "--rollback", "--rootfs", str(tmp_path))
    assert r.exit_code == 2 and "exclude each other" in r.output


def test_gpu_settings_are_only_printed(tmp_path):
    f = edit_gpu0(h200(), persistence=0, mig=[1, 1], ecc=[0, 0])
    pl = H.plan(str(host(tmp_path)), f)
    text = "\n".join(pl.manual)
    assert "nvidia-persistenced" in text and "-mig 0" in text and "-e 1" in text
    assert all("nvidia" not in p for c in pl.changes for p in c.paths)


def test_sysctl_dropin_text_is_what_install_reuses():
    text = H.sysctl_dropin_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == ["kernel.numa_balancing = 0"]
    lowered = H.sysctl_dropin_text(("kernel.io_uring_disabled",))
    assert "-kernel.io_uring_disabled = 0" in lowered.splitlines()


def test_harden_never_enables_a_disabled_io_uring_unless_asked_by_name(tmp_path):
    root = host(tmp_path)
    (root / "proc/sys/kernel/io_uring_disabled").write_text("2\n")
    r = harden("--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert "io_uring" not in r.output
    r = harden("--apply", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert (root / "proc/sys/kernel/io_uring_disabled").read_text().strip() == "2"
    assert "io_uring" not in (root / H.SYSCTL_DROPIN).read_text()
    # asked for by name: planned, applied, persisted, and kept by a later plain apply
    r = harden("--apply", "--enable-io-uring", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert "kernel.io_uring_disabled: 2 -> 0" in r.output
    assert (root / "proc/sys/kernel/io_uring_disabled").read_text().strip() == "0"
    assert "-kernel.io_uring_disabled = 0" in (root / H.SYSCTL_DROPIN).read_text()
    r = harden("--rootfs", str(root))
    assert "sysctl drop-in" not in r.output, r.output
    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert (root / "proc/sys/kernel/io_uring_disabled").read_text().strip() == "2"


@pytest.mark.parametrize("state", ['[]', '{"records": 5}', '{"records": [7]}',
                                   '{"records": [{"path": "/x", "key": "k", "kind": "value", "before": 3}]}',
                                   '{"records": [{"path": "nvml:GPU-1", "key": "k", "kind": "compute_mode", '
                                   '"before": "x"}]}',
                                   '{"records": [], "dirs": [1]}'])
def test_a_damaged_state_file_is_named_not_an_internal_error(tmp_path, state):
    root = host(tmp_path)
    (root / H.STATE_FILE).parent.mkdir(parents=True)
    (root / H.STATE_FILE).write_text(state)
    before = snapshot(root)
    for args in (["--rollback"], ["--apply"]):
        r = harden(*args, "--rootfs", str(root))
        assert r.exit_code == 1, r.output
        assert "is damaged" in r.output and "internal error" not in r.output
        assert snapshot(root) == before


def _as_nobody(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                           "-m", "zerod", "harden", *args], capture_output=True, text=True, cwd=REPO,
                          env={**cli_env(), "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}, timeout=60)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="drops to an unprivileged user with setpriv, which needs root")


@needs_root
def test_refuses_without_rights_and_changes_nothing():
    root = Path(tempfile.mkdtemp(prefix="zerod-harden-"))
    try:
        host(root)
        for dirpath, dirnames, files in os.walk(root):  # readable, not writable, by others
            os.chmod(dirpath, 0o755)
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644)
        before = snapshot(root)
        p = _as_nobody("--apply", "--rootfs", str(root))
        assert p.returncode == 1, p.stdout + p.stderr
        assert "refused" in p.stderr and "permission denied" in p.stderr and "nothing was changed" in p.stderr
        assert "Traceback" not in p.stderr
        assert snapshot(root) == before
        # and on the real root, without --rootfs: root is required, the host is untouched
        p = _as_nobody("--apply")
        assert p.returncode == 1 and "needs root" in p.stderr and "Traceback" not in p.stderr
    finally:
        shutil.rmtree(root)


def test_second_apply_keeps_the_first_values_for_rollback(tmp_path):
    root = host(tmp_path)
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    # something sets numa_balancing back to 1 (and nothing else changes): apply again
    (root / "proc/sys/kernel/numa_balancing").write_text("1\n")
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "0"
    assert harden("--rollback", "--rootfs", str(root)).exit_code == 0
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "1"
    assert thp(root) == "always"


def test_plan_as_json(tmp_path):
    import json

    d = json.loads(harden("--json", "--rootfs", str(host(tmp_path))).output)
    keys = [c["key"] for c in d["changes"]]
    assert keys[0] == "kernel.numa_balancing" and "zerod.service memlock" in keys
    c = d["changes"][0]
    assert (c["now"], c["after"], c["persist"]) == ("1", "0", "/etc/sysctl.d/60-zerod.conf")


def test_a_drifted_value_never_shrinks_the_persisted_state(tmp_path):
    """Apply, one value drifts, apply again: the boot-time files still hold every setting."""
    root = host(tmp_path)
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    persisted = {rel: (root / rel).read_text() for rel in (H.TMPFILES_DROPIN, H.SYSCTL_DROPIN, H.MEMLOCK_DROPIN)}
    tmpfiles = persisted[H.TMPFILES_DROPIN]
    assert "enabled - - - - madvise" in tmpfiles and "defrag - - - - madvise" in tmpfiles
    assert "scaling_governor - - - - performance" in tmpfiles
    for drift in ("sys/kernel/mm/transparent_hugepage/enabled", "sys/devices/system/cpu/cpu1/cpufreq/scaling_governor"):
        (root / drift).write_text("[always] madvise never\n" if "hugepage" in drift else "powersave\n")
        r = harden("--apply", "--rootfs", str(root))
        assert r.exit_code == 0 and "applied:" in r.output, r.output
        assert {rel: (root / rel).read_text() for rel in persisted} == persisted, drift
    assert thp(root) == "madvise"
    # and rollback still goes back to the very first values
    assert harden("--rollback", "--rootfs", str(root)).exit_code == 0
    assert thp(root) == "always" and not (root / H.TMPFILES_DROPIN).exists()


def test_rollback_removes_the_folders_apply_made(tmp_path):
    root = host(tmp_path)
    dirs_before = sorted(p for p, _, _ in os.walk(root))
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    assert (root / "etc/systemd/system/zerod.service.d").is_dir() and (root / "var/lib/zerod").is_dir()
    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 0 and "removed folder" in r.output, r.output
    assert sorted(p for p, _, _ in os.walk(root)) == dirs_before


def test_rollback_keeps_a_made_folder_someone_filled(tmp_path):
    root = host(tmp_path)
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    mine = root / "etc/systemd/system/zerod.service.d/50-numa.conf"  # e.g. written by zerod install
    mine.write_text("[Service]\n")
    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 0 and "kept folder" in r.output and "not empty" in r.output
    assert mine.read_text() == "[Service]\n" and not (root / H.MEMLOCK_DROPIN).exists()


def _escape(root: Path, outside: Path, how: str) -> None:
    """etc/sysctl.d as a symlink out of the root: absolute, or relative climbing with ../."""
    outside.mkdir()
    link = root / "etc/sysctl.d"
    os.symlink(str(outside) if how == "absolute" else os.path.relpath(outside, link.parent), link)


@pytest.mark.parametrize("how", ["absolute", "relative"])
@pytest.mark.parametrize("mode", [[], ["--apply"]])
def test_a_symlink_out_of_rootfs_is_refused(tmp_path, how, mode):
    root = host(tmp_path / "root")
    outside = tmp_path / "host-etc-sysctl.d"  # stands for the real /etc/sysctl.d
    _escape(root, outside, how)
    before = snapshot(root)
    r = harden(*mode, "--rootfs", str(root))
    assert r.exit_code == 1, r.output
    assert "etc/sysctl.d" in r.output and "outside" in r.output and "Traceback" not in r.output
    assert list(outside.iterdir()) == [] and snapshot(root) == before


def test_rollback_refuses_a_symlink_planted_after_apply(tmp_path):
    root = host(tmp_path / "root")
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    shutil.rmtree(root / "etc/sysctl.d")
    outside = tmp_path / "host-etc-sysctl.d"
    _escape(root, outside, "absolute")
    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 1 and "outside" in r.output and "nothing was changed" in r.output
    assert list(outside.iterdir()) == [] and (root / H.STATE_FILE).exists()
    assert (root / "proc/sys/kernel/numa_balancing").read_text().strip() == "0"  # not half rolled back


def test_relative_links_inside_rootfs_are_followed(tmp_path):
    """Real sysfs: cpuN/cpufreq -> ../cpufreq/policyN."""
    root = host(tmp_path)
    cpu = root / "sys/devices/system/cpu"
    (cpu / "cpufreq/policy2").mkdir(parents=True)
    shutil.move(cpu / "cpu2/cpufreq/scaling_governor", cpu / "cpufreq/policy2/scaling_governor")
    (cpu / "cpu2/cpufreq").rmdir()
    os.symlink("../cpufreq/policy2", cpu / "cpu2/cpufreq")
    assert harden("--apply", "--rootfs", str(root)).exit_code == 0
    assert (cpu / "cpufreq/policy2/scaling_governor").read_text().strip() == "performance"


# -- --exclusive-gpu: the compute mode through NVML (a pynvml-shaped fake: no GPU here) ------

class FakeNvml:
    """Two GPUs as NVML shows them; setting a mode needs root unless `root`."""

    import pynvml as _p

    NVMLError = _p.NVMLError

    def __init__(self, modes=(0, 0), root=True, lost=None):
        self.modes, self.root, self.lost = list(modes), root, lost
        self.sets: list[tuple[int, int]] = []

    def nvmlDeviceGetCount(self):
        return len(self.modes)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.split("-")[1])

    def nvmlDeviceGetComputeMode(self, h):
        return self.modes[h]

    def nvmlDeviceSetComputeMode(self, h, mode):
        if not self.root:
            raise self._p.NVMLError(self._p.NVML_ERROR_NO_PERMISSION)
        if h == self.lost:
            raise self._p.NVMLError(self._p.NVML_ERROR_GPU_IS_LOST)
        self.modes[h] = mode
        self.sets.append((h, mode))


@pytest.fixture
def nvml(monkeypatch):
    from zerod.checks import compute_mode as cm

    fake = FakeNvml()
    real = cm.NvmlComputeModes
    monkeypatch.setattr(cm, "NvmlComputeModes", lambda: real(nvml=fake))
    return fake


def test_exclusive_gpu_plan_apply_and_rollback(tmp_path, nvml):
    root = host(tmp_path)
    nvml.modes = [0, 3]  # GPU 1 is already exclusive: nothing to change there
    r = harden("--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert "GPU 0 compute mode: Default -> Exclusive_Process (NVML, GPU-0)" in r.output
    assert "GPU 1 compute mode" not in r.output and "until the driver reloads" in r.output
    assert nvml.sets == []  # the plan is a dry run
    r = harden("--apply", "--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert nvml.modes == [3, 3] and "GPU 0 compute mode: Default -> Exclusive_Process" in r.output
    r = harden("--rollback", "--rootfs", str(root))
    assert r.exit_code == 0, r.output
    assert nvml.modes == [0, 3] and "GPU 0 compute mode: restored Default" in r.output
    assert not (root / H.STATE_FILE).exists()


def test_exclusive_gpu_without_rights_is_refused_and_undone(tmp_path, nvml):
    root = host(tmp_path)
    nvml.root = False
    before = snapshot(root)
    r = harden("--apply", "--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 1
    assert "refused" in r.output and "needs root" in r.output and "every change was rolled back" in r.output
    assert nvml.modes == [0, 0]
    assert snapshot(root) == before | {"sys/kernel/mm/transparent_hugepage/enabled": "always\n"}
    assert not (root / H.STATE_FILE).exists()


def test_a_gpu_failing_half_way_restores_the_others(tmp_path, nvml):
    root = host(tmp_path)
    nvml.lost = 1
    r = harden("--apply", "--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 1 and "GPU is lost" in r.output and "every change was rolled back" in r.output
    assert nvml.modes == [0, 0] and nvml.sets == [(0, 3), (0, 0)]  # set, then put back


def test_exclusive_gpu_without_a_driver_says_so(tmp_path):
    root = host(tmp_path)
    before = snapshot(root)
    r = harden("--apply", "--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 1 and "--exclusive-gpu: cannot reach the GPUs" in r.output
    assert "nothing was changed" in r.output and snapshot(root) == before
    r = harden("--rollback", "--exclusive-gpu", "--rootfs", str(root))
    assert r.exit_code == 2 and "leave out --exclusive-gpu" in r.output
