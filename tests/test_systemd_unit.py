"""The unit, checked by the real systemd-analyze (verify: no output; security
--offline: exposure <= 1.5), the example config documenting every key, the
sysctl drop-in equal to `zerod harden`'s, and the Prometheus rules by promtool."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from zerod.install import plan_install, write_plan

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (Debian package systemd)")


@pytest.fixture
def installed_unit(tmp_path):
    """The unit as `zerod install` writes it: ExecStart is this Python (verify
    checks that the binary exists)."""
    plan = plan_install(rootfs=str(tmp_path), exec_start=f"{sys.executable} -m zerod", bus_id=None)
    write_plan(plan)
    return tmp_path / "etc/systemd/system/zerod.service"


@needs_analyze
def test_systemd_analyze_verify_prints_nothing(installed_unit):
    r = subprocess.run(["systemd-analyze", "verify", str(installed_unit)], capture_output=True, text=True,
                       cwd=installed_unit.parent, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


@needs_analyze
def test_systemd_analyze_security_exposure_at_most_1_5(installed_unit):
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(installed_unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 1.5, r.stdout


def test_unit_is_the_hardened_gpu_service():
    text = (SYSTEMD / "zerod.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=", "DevicePolicy=closed", "PrivateDevices=no",
                 "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=char-nvidia-frontend rw", "LimitMEMLOCK=infinity",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=\n",
                 "SystemCallFilter=@system-service",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", "RuntimeDirectory=zerod",
                 "RestartPreventExitStatus=78", "KillMode=mixed"):
        assert line in text, line


def test_config_and_api_key_are_optional_credentials():
    """Both files reach the dynamic user as credentials; a missing file falls back to the
    SetCredential= of the same ID (systemd.exec(5)), which must mean "defaults" / "no key"."""
    text = (SYSTEMD / "zerod.service").read_text()
    load = dict(re.findall(r"^LoadCredential=([^:\n]+):(.+)$", text, flags=re.M))
    fallback = {k: v.encode().decode("unicode_escape")  # systemd C-unescapes the value
                for k, v in re.findall(r"^SetCredential=([^:\n]+):(.+)$", text, flags=re.M)}
    assert load == {"zerod.toml": "/etc/zerod/zerod.toml", "api_key": "/etc/zerod/api_key"}
    assert set(fallback) == set(load)
    assert tomllib.loads(fallback["zerod.toml"]) == {}  # every section at its defaults
    assert fallback["api_key"].strip() == ""
    exec_start = re.search(r"^ExecStart=(.*)$", text, flags=re.M).group(1)
    assert exec_start.endswith(" run --config ${CREDENTIALS_DIRECTORY}/zerod.toml")


def _section_keys(text: str) -> dict[str, set[str]]:
    """Keys written (commented out) under each [section] of the example."""
    out: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        m = re.match(r"^\[(\w+)\]", line)
        if m:
            section = m.group(1)
            out.setdefault(section, set())
            continue
        m = re.match(r"^# (\w+) = ", line)
        if m and section:
            out[section].add(m.group(1))
        m = re.match(r"^# \[(\w+)\.(\w+)\]", line)
        if m:
            out.setdefault(m.group(1), set()).add(m.group(2))
    return out


def test_example_config_documents_every_key_and_parses():
    text = (SYSTEMD / "zerod.toml.example").read_text()
    data = tomllib.loads(text)
    assert set(data) == {"doctor", "engine", "daemon", "alerts"} and all(v == {} for v in data.values())
    keys = _section_keys(text)
    from zerod.checks.config import DoctorConfig
    from zerod.daemon_config import AlertsConfig, DaemonConfig
    from zerod.engine.cli import serve

    for section, cls in (("doctor", DoctorConfig), ("daemon", DaemonConfig), ("alerts", AlertsConfig)):
        missing = {f.name for f in dataclasses.fields(cls)} - keys[section]
        assert not missing, f"[{section}] keys not documented: {missing}"
    flags = {p.name for p in serve.params if p.name not in ("help",)}
    missing = flags - keys["engine"]
    assert not missing, f"[engine] serve flags not documented: {missing}"


def test_sysctl_dropin_is_harden_s():
    from zerod.checks.harden import sysctl_dropin_text

    assert (SYSTEMD / "60-zerod.conf").read_text() == sysctl_dropin_text()
    assert "kernel.numa_balancing = 0" in sysctl_dropin_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_prometheus_rules_pass_promtool():
    r = subprocess.run(["promtool", "check", "rules", str(ROOT / "prometheus/zerod-rules.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # that its rules match the registered alerts: tests/test_registry.py
