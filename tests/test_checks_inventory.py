"""gpu.count, host.disk_space, gpu.stuck_processes and gpu.diag: on the recorded H200
snapshot with the fact each reads edited to what a broken host reads, and the probes
of the last two on a made-up /proc and state directory."""

from __future__ import annotations

import json
import time

import pytest

from test_checks_helpers import edit, h200, result

from zerod.checks import DoctorConfig
from zerod.checks.facts import Roots
from zerod.checks.probe_diag import probe as probe_diag
from zerod.checks.probe_stuck import probe as probe_stuck
from zerod.checks.state_dir import diag_result_path, state_dir

GiB = 1 << 30


def _disk(free: int, total: int = 500 * GiB) -> list[dict]:
    return [{"what": "huggingface cache", "path": "/srv/hf", "statvfs": "/srv", "free_bytes": free,
             "total_bytes": total},
            {"what": "state directory", "path": "/var/lib/zerod", "statvfs": "/var/lib", "free_bytes": 80 * GiB,
             "total_bytes": total}]


def _diag(*tests: tuple[str, int | None, str, str]) -> dict:
    return {"time": "2026-12-03T18:00:00+00:00", "started_at": time.time() - 7200, "level": "quick",
            "tests": [{"id": i, "gpu": g, "peer": None, "status": s, "message": m} for i, g, s, m in tests]}


STUCK = {"read_gap_s": 0.5, "holders": 3, "stuck": [
    {"pid": 4242, "name": "python3", "devices": ["/dev/nvidia0", "/dev/nvidiactl"], "gpus": [0],
     "wchan": "os_acquire_mutex"}]}

# (check, config, how the host is broken, expected status, words the message must hold)
BROKEN = [
    ("gpu.count", DoctorConfig(expected_gpus=8), lambda f: f, "fail", "NVML shows 1 GPU(s), 8 expected"),
    ("gpu.count", DoctorConfig(expected_gpus=1), lambda f: edit(f, "nvml", {**f.value("nvml"), "count": 2}),
     "warn", "2 GPUs, 1 expected"),
    ("host.disk_space", None, lambda f: edit(f, "disk.free", _disk(3 * GiB)), "warn", "/srv/hf: 3.0 GiB free"),
    ("host.disk_space", None, lambda f: edit(f, "disk.free", _disk(GiB // 2)), "fail", "below 1 GiB"),
    ("gpu.stuck_processes", None, lambda f: edit(f, "gpu.stuck_processes", STUCK), "fail",
     "python3 (pid 4242, waiting in os_acquire_mutex"),
    ("gpu.diag", None, lambda f: edit(f, "diag.last", _diag(
        ("diag.cuda_context", 0, "pass", "ok"),
        ("diag.gemm_bf16", 0, "fail", "the product is wrong (see the residuals)"))),
     "fail", "diag.gemm_bf16 on GPU 0 fail: the product is wrong"),
    ("gpu.diag", None, lambda f: edit(f, "diag.last", _diag(
        ("diag.hbm_bandwidth", 0, "warn", "copy: 2,400.0 GB/s, 50 % of the spec 4,800 GB/s"))),
     "warn", "50 % of the spec"),
]


@pytest.mark.parametrize("cid,cfg,broken,status,words", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_check_on_broken_host(cid, cfg, broken, status, words):
    r = result(broken(h200()), cid, cfg)
    assert (r.status, words in r.message) == (status, True), r.message
    assert r.remediation and r.evidence


def test_healthy_cases_pass():
    f = edit(edit(edit(h200(), "disk.free", _disk(200 * GiB)), "gpu.stuck_processes",
                  {"read_gap_s": 0.5, "holders": 2, "stuck": []}),
             "diag.last", _diag(("diag.gemm_bf16", 0, "pass", "fine"), ("diag.p2p_bandwidth", 0, "skip", "one GPU")))
    assert result(f, "gpu.count", DoctorConfig(expected_gpus=1)).status == "pass"
    assert result(f, "host.disk_space").status == "pass"
    assert result(f, "gpu.stuck_processes").status == "pass"
    r = result(f, "gpu.diag")
    assert r.status == "pass" and "1 test(s) passed" in r.message and "2.0 h ago" in r.message


def test_diag_result_of_another_gpu_does_not_count_for_this_engine():
    f = edit(h200(), "diag.last", _diag(("diag.gemm_bf16", 0, "pass", "fine"), ("diag.gemm_bf16", 1, "fail", "wrong")))
    assert result(f, "gpu.diag", DoctorConfig(gpus=(0,))).status == "pass"
    assert result(f, "gpu.diag").status == "fail"


def test_diag_result_of_a_replaced_board_does_not_count():
    uuid = h200().value("nvml.gpus")[0]["uuid"]
    failing = _diag(("diag.gemm_bf16", 0, "fail", "wrong"))
    same = edit(h200(), "diag.last", {**failing, "gpus": [{"index": 0, "uuid": uuid}]})
    assert result(same, "gpu.diag").status == "fail"
    other = edit(h200(), "diag.last", {**failing, "gpus": [{"index": 0, "uuid": "GPU-replaced-since"}]})
    r = result(other, "gpu.diag")
    assert r.status == "skip" and "has another UUID now" in r.message


def test_no_diag_result_skips_and_names_the_file(tmp_path):
    facts = h200()
    probe_diag(facts, Roots(), str(tmp_path))
    r = result(facts, "gpu.diag")
    assert r.status == "skip" and str(tmp_path / "diag.json") in r.message


def test_probe_reads_the_kept_report(tmp_path):
    report = {"host": {"time": "t", "started_at": 1.0, "level": "full"}, "summary": {},
              "tests": [{"id": "diag.gemm_bf16", "gpu": 0, "peer": None, "status": "fail", "message": "wrong",
                         "evidence": [{"big": "x" * 100}]}]}
    (tmp_path / "diag.json").write_text(json.dumps(report))
    facts = h200()
    probe_diag(facts, Roots(), str(tmp_path))
    last = facts.value("diag.last")
    assert last["level"] == "full" and last["gpus"] == [] and last["tests"] == [
        {"id": "diag.gemm_bf16", "gpu": 0, "peer": None, "status": "fail", "message": "wrong"}]
    (tmp_path / "diag.json").write_text("not json")
    facts = h200()
    probe_diag(facts, Roots(), str(tmp_path))
    assert result(facts, "gpu.diag").status == "error"


def test_state_dir_rule():
    assert state_dir("/srv/z", env={}, euid=0) == "/srv/z"
    assert state_dir(None, env={"STATE_DIRECTORY": "/var/lib/zerod"}, euid=999) == "/var/lib/zerod"
    assert state_dir(None, env={}, euid=0) == "/var/lib/zerod"
    assert state_dir(None, env={"HOME": "/home/ann"}, euid=1000) == "/home/ann/.local/state/zerod"
    assert state_dir(None, env={"ZEROD_STATE_DIR": "/t", "STATE_DIRECTORY": "/s"}, euid=0) == "/t"
    assert diag_result_path(None, env={"XDG_STATE_HOME": "/c"}, euid=1000) == "/c/zerod/diag.json"


def _proc(root, pid: int, state: str, name: str = "python3") -> None:
    d = root / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({name} x) {state} 1 1 1 0 -1\n")
    (d / "wchan").write_text("os_acquire_mutex")


def test_stuck_probe_reads_state_twice(tmp_path):
    _proc(tmp_path, 10, "D")
    _proc(tmp_path, 11, "S")
    facts = h200()
    facts.put("gpu.processes", [{"pid": 10, "name": "python3", "devices": ["/dev/nvidia0"], "gpus": [0]},
                                {"pid": 11, "name": "agent", "devices": ["/dev/nvidiactl"], "gpus": []}], "test")
    probe_stuck(facts, Roots.make(rootfs=str(tmp_path)))
    doc = facts.value("gpu.stuck_processes")
    assert [p["pid"] for p in doc["stuck"]] == [10] and doc["stuck"][0]["wchan"] == "os_acquire_mutex"
    r = result(facts, "gpu.stuck_processes")
    assert r.status == "fail" and "pid 10" in r.message and "pid 11" not in r.message


def test_config_keys_are_checked():
    for bad in (0, True, "8"):
        with pytest.raises(ValueError, match="expected_gpus"):
            DoctorConfig.from_dict({"expected_gpus": bad})
    with pytest.raises(ValueError, match="min_free_disk_bytes"):
        DoctorConfig.from_dict({"min_free_disk_bytes": -1})
    assert DoctorConfig.from_config({"daemon": {"state_dir": "/srv/state"}}).state_dir == "/srv/state"
