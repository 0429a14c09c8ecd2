"""`zerod install --rootfs DIR [--dry-run]`: the unit with the real ExecStart,
the sysctl drop-in, a NUMA drop-in from the GPU's node, the example config
(kept when one exists)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from zerod.install import InstallError, default_exec_start, plan_install, write_plan

ROOT = Path(__file__).resolve().parent.parent


def fake_sysfs(tmp_path):
    sysfs = tmp_path / "sys"
    dev = sysfs / "bus/pci/devices/0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    for n, cpus in ((0, "0-7"), (1, "8-15")):
        d = sysfs / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (sysfs / "devices/system/node/online").write_text("0-1\n")
    return str(sysfs)


def test_install_writes_unit_dropins_and_config(tmp_path):
    root = tmp_path / "root"
    plan = plan_install(rootfs=str(root), exec_start="/opt/zerod/bin/zerod", sysfs=fake_sysfs(tmp_path),
                        bus_id="00000000:18:00.0")
    done = write_plan(plan)
    unit = (root / "etc/systemd/system/zerod.service").read_text()
    assert "ExecStart=/opt/zerod/bin/zerod run --config ${CREDENTIALS_DIRECTORY}/zerod.toml" in unit
    assert "LoadCredential=zerod.toml:/etc/zerod/zerod.toml" in unit
    assert "LoadCredential=api_key:/etc/zerod/api_key" in unit
    assert unit.count("ExecStart=") == 1
    numa = (root / "etc/systemd/system/zerod.service.d/50-numa.conf").read_text()
    assert "CPUAffinity=8-15" in numa and "NUMAPolicy=bind" in numa and "NUMAMask=1" in numa
    assert "kernel.numa_balancing = 0" in (root / "etc/sysctl.d/60-zerod.conf").read_text()
    cfg = root / "etc/zerod/zerod.toml"
    assert cfg.read_text() == (ROOT / "systemd/zerod.toml.example").read_text()
    assert all(what == "wrote" for _, what in done)
    # a person's config is never overwritten
    cfg.write_text("[engine]\nmodel = 'mine'\n")
    done = dict(write_plan(plan))
    assert done[str(cfg)] == "kept (exists)" and "mine" in cfg.read_text()


def test_no_gpu_numa_dropin_pins_nothing(tmp_path):
    plan = plan_install(rootfs=str(tmp_path), exec_start="/usr/bin/zerod", bus_id=None, nvml=_NoNvml())
    text = next(f.content for f in plan.files if f.path.endswith("50-numa.conf"))
    assert "[Service]" in text and "CPUAffinity" not in text and "nothing pinned" in text


class _NoNvml:
    class NVMLError(Exception):
        value = 12

    def nvmlInit(self):
        raise self.NVMLError()


def test_default_exec_start_is_a_real_path():
    exe = default_exec_start()
    first = exe.split()[0].strip("'")
    assert Path(first).is_file()


def test_cli_dry_run_writes_nothing_and_real_run_writes(tmp_path):
    root = tmp_path / "root"
    r = subprocess.run([sys.executable, "-m", "zerod", "install", "--rootfs", str(root), "--dry-run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ExecStart=" in r.stdout and "(dry run: nothing written)" in r.stdout
    assert "etc/systemd/system/zerod.service.d/50-numa.conf" in r.stdout
    assert not root.exists()
    r = subprocess.run([sys.executable, "-m", "zerod", "install", "--rootfs", str(root)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    unit = (root / "etc/systemd/system/zerod.service").read_text()
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith(" run --config ${CREDENTIALS_DIRECTORY}/zerod.toml")
    assert Path(exec_line[len("ExecStart="):].split()[0]).exists()


def test_install_refuses_clearly_without_rights(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = subprocess.run([sys.executable, "-m", "zerod", "install", "--rootfs", str(ro)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    ro.chmod(0o700)
    if os.geteuid() == 0:  # root writes anyway
        assert r.returncode == 0
    else:
        assert r.returncode != 0 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def _install(root: Path):
    return write_plan(plan_install(rootfs=str(root), exec_start="/opt/zerod/bin/zerod", bus_id=None, nvml=_NoNvml()))


@pytest.mark.parametrize("group_line,gid", [("zerod:x:4242:alice,bob\n", 4242), ("", 0)])
def test_config_is_0640_root_and_the_zerod_group(tmp_path, group_line, gid):
    """The config may hold the API key: never readable by everyone."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/group").write_text("root:x:0:\nadm:x:4:\n" + group_line)
    _install(root)
    st = os.stat(root / "etc/zerod/zerod.toml")
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert stat.S_IMODE(os.stat(root / "etc/systemd/system/zerod.service").st_mode) == 0o644
    if os.geteuid() == 0:  # only root can give the file away
        assert (st.st_uid, st.st_gid) == (0, gid)


def test_an_older_world_readable_config_is_closed_not_rewritten(tmp_path):
    root = tmp_path / "root"
    cfg = root / "etc/zerod/zerod.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("[engine]\napi_key = 'sk-mine'\n")
    cfg.chmod(0o644)
    done = dict(_install(root))
    assert done[str(cfg)] == "kept (exists), now mode 640"
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o640 and "sk-mine" in cfg.read_text()
    assert dict(_install(root))[str(cfg)] == "kept (exists)"  # already closed: untouched


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_symlink_out_of_rootfs_is_refused(tmp_path, how):
    """An image whose etc/systemd/system points at the host's: install must not write there."""
    root = tmp_path / "root"
    outside = tmp_path / "host-systemd-system"
    outside.mkdir()
    link = root / "etc/systemd/system"
    link.parent.mkdir(parents=True)
    os.symlink(str(outside) if how == "absolute" else os.path.relpath(outside, link.parent), link)
    with pytest.raises(InstallError, match="outside"):
        _install(root)
    r = subprocess.run([sys.executable, "-m", "zerod", "install", "--rootfs", str(root)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "etc/systemd/system" in r.stderr and "Traceback" not in r.stderr
    assert list(outside.iterdir()) == [] and not (root / "etc/zerod").exists()


def test_install_warns_about_paths_the_unit_hides(tmp_path):
    """The unit has PrivateTmp=yes and ProtectHome=yes: an ExecStart under /tmp, or a
    script whose #! interpreter is under /root, would not be found when it starts."""
    from zerod.install import hidden_by_unit

    notes = hidden_by_unit("/tmp/venv/bin/zerod")
    assert any("ExecStart /tmp/venv/bin/zerod" in n and "PrivateTmp=yes" in n for n in notes), notes
    script = tmp_path / "zerod"
    script.write_text("#!/root/.venv/bin/python3\nimport zerod\n")
    notes = hidden_by_unit(str(script))
    assert any(n.startswith("its interpreter /root/.venv/bin/python3") and "ProtectHome=yes" in n
               for n in notes), notes
    env_script = tmp_path / "zerod-env"
    env_script.write_text("#!/usr/bin/env /home/ops/venv/bin/python\n")
    assert any("its interpreter /home/ops/venv/bin/python" in n for n in hidden_by_unit(str(env_script)))
    assert not [n for n in hidden_by_unit("/opt/zerod/bin/zerod") if "ExecStart" in n or "interpreter" in n]
    plan = plan_install(rootfs=str(tmp_path / "root"), exec_start="/tmp/venv/bin/zerod",
                        sysfs=fake_sysfs(tmp_path), bus_id="00000000:18:00.0")
    assert any("PrivateTmp=yes" in n for n in plan.notes)
