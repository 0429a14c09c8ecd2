"""What the device H200 returned (`gpu/daemon.sh doctor`, gpu/results/daemon.md): the saved
snapshot (tests/fixtures/facts/h200.json) replays to the report doctor printed there, and the
recorded facts look like a real NVML host. The reports and the wall time doctor wrote on the
device are kept as test data: tests/fixtures/control_api/doctor-h200.json (idle) and
tests/fixtures/doctor_h200/."""

from __future__ import annotations

import json

from test_checks_helpers import FACTS_DIR, h200

from zerod.checks import run_checks

DEVICE = FACTS_DIR.parent / "doctor_h200"
IDLE_REPORT = FACTS_DIR.parent / "control_api" / "doctor-h200.json"


def test_snapshot_is_the_one_from_the_device():
    f = h200()
    (g,) = f.value("nvml.gpus")
    assert g["name"] == "NVIDIA H200" and g["cc"] == [9, 0] and g["memory"]["total"] > 140 << 30
    assert f.value("nvml")["driver_version"] == "580.159.04"
    assert f.value("torch.install")["cuda"] == "13.0"


# Messages deliberately reworded since the device run, as (what the device printed, what
# doctor prints now from the same facts); the recorded report stays as it was printed.
# kernel.io_uring says why it passes (08b3cad: harden never lowers the setting, zerod uses
# no io_uring).
REWORDED = {
    "kernel.io_uring": ("CONFIG_IO_URING=y; kernel.io_uring_disabled = 0",
                        "CONFIG_IO_URING=y; kernel.io_uring_disabled = 0; zerod does not use io_uring"),
}


def test_replay_gives_the_report_printed_on_the_device():
    there = json.loads(IDLE_REPORT.read_text())
    here = run_checks(h200()).to_dict()
    # the checks added since the device run skip on this snapshot: it lacks their facts
    ids = {c["id"] for c in there["checks"]}
    printed = {c["id"]: c["message"] for c in there["checks"]}
    assert {cid: printed[cid] for cid in REWORDED} == {cid: old for cid, (old, _) in REWORDED.items()}
    now = {cid: new for cid, (_, new) in REWORDED.items()}
    assert [(c["id"], c["status"], c["message"]) for c in here["checks"] if c["id"] in ids] == [
        (c["id"], c["status"], now.get(c["id"], c["message"])) for c in there["checks"]]
    assert {c["status"] for c in here["checks"] if c["id"] not in ids} == {"skip"}
    assert there["summary"]["exit_code"] == here["summary"]["exit_code"] == 0


def test_the_fd_scan_saw_doctor_itself_and_knew_it():
    f = h200()
    (p,) = f.value("gpu.processes")
    assert p["source"] == "fd" and "/dev/nvidiactl" in p["devices"] and p["pid"] in f.value("self.pids")
    r = {c.id: c for c in run_checks(f).checks}["gpu.foreign_processes"]
    assert r.status == "pass" and r.evidence[0]["value"]["role"] == "self"


def test_walltime_within_budget():
    w = json.loads((DEVICE / "walltime.json").read_text())
    assert w["median_s"] <= 1.0 and w["exit_codes"] == [0]


def test_stand_in_agents_on_the_h200_are_named_with_their_fix():
    """Second device run (`gpu/daemon.sh doctor`, gpu/results/daemon.md): one process holding
    2.5 GiB as dcgm-exporter (in NVML's list) and one that only called nvmlInit as
    datadog-agent (in no NVML list: the fd scan alone finds it)."""
    from test_checks_helpers import load

    f = load("h200-foreign-agents")
    report = run_checks(f)
    r = {c.id: c for c in report.checks}["gpu.foreign_processes"]
    assert r.status == "fail" and report.exit_code == 2
    assert "dcgm-exporter" in r.message and "datadog-agent" in r.message
    assert "2.5 GiB" in r.message and "fd scan; no CUDA context" in r.message
    assert "dcgm-exporter" in r.remediation and "/etc/datadog-agent/conf.d/nvml.d" in r.remediation
    procs = {p["name"]: p for p in f.value("gpu.processes")}
    assert procs["dcgm-exporter"]["source"] != "fd" and procs["dcgm-exporter"]["gpu_memory_bytes"] > 2 << 30
    assert procs["datadog-agent"]["source"] == "fd"
    # what doctor printed on the device is what the snapshot replays to
    there = json.loads((DEVICE / "doctor-foreign.json").read_text())
    assert {c["id"]: c["status"] for c in there["checks"]} == {
        c.id: c.status for c in report.checks if c.id in {x["id"] for x in there["checks"]}}
