"""Every check of the catalogue on recorded snapshots: the real H200 one passes, and a
snapshot edited to read what a broken host reads makes it warn or fail, saying why."""

from __future__ import annotations

import pytest

from test_checks_helpers import edit, edit_gpu0, h200, load, result, statuses

from zerod.checks import CATALOGUE, REGISTRY, DoctorConfig, run_checks
from zerod.checks.report import STATUSES

GiB = 1 << 30


def test_catalogue_matches_design_ids():
    assert set(REGISTRY) == set(CATALOGUE)
    assert len(CATALOGUE) == 34
    for cid, chk in REGISTRY.items():
        assert chk.severity in ("critical", "major", "minor")
        assert chk.title


def test_real_h200_snapshot_passes_everything():
    report = run_checks(h200())
    bad = {c.id: (c.status, c.message) for c in report.checks if c.status not in ("pass", "skip")}
    assert bad == {}
    skipped = {c.id for c in report.checks if c.status == "skip"}
    # not an NVSwitch box, no cpufreq in the VM, no model configured, one GPU (no peer); and what the
    # snapshot predates (h200-fleet.json, in test_checks_platform.py, has most of it)
    assert skipped == {"gpu.fabric_manager", "gpu.nvlink", "gpu.p2p", "cpu.governor", "engine.config", "gpu.recovery_action",
                       "gpu.firmware", "gpu.compute_mode", "host.iommu", "host.container_runtime", "mem.swap",
                       "gpu.count", "gpu.stuck_processes", "gpu.diag", "host.disk_space"}
    assert report.exit_code == 0


# (check, how the host is broken, expected status, words the message must hold)
BROKEN = [
    ("gpu.compute_capability", lambda f: edit_gpu0(f, cc=[7, 0], name="Tesla V100"), "fail", "sm_70"),
    ("gpu.compute_capability", lambda f: edit_gpu0(f, cc=[7, 5], name="Tesla T4"), "fail", "sm_75"),
    ("gpu.driver_version", lambda f: edit(f, "nvml", {**f.value("nvml"), "driver_version": "520.61.05"}),
     "fail", "older than 525.60.13"),
    ("gpu.cuda_compat", lambda f: edit(f, "nvml", {**f.value("nvml"), "cuda_driver_version": 12020}),
     "fail", "CUDA 12.2"),
    ("gpu.cuda_compat", lambda f: edit(f, "torch.install", {"version": "2.13.0+cpu", "cuda": None, "path": "x"}),
     "fail", "CPU-only"),
    ("gpu.cuda_compat", lambda f: edit(f, "torch.install", {"version": "2.11.0+cu132", "cuda": "13.2", "path": "x"}),
     "warn", "minor-version"),
    ("gpu.persistence_mode", lambda f: edit_gpu0(f, persistence=0), "warn", "persistence mode off"),
    ("gpu.ecc_health", lambda f: edit_gpu0(f, ecc=[0, 0]), "warn", "ECC is off"),
    ("gpu.ecc_health", lambda f: edit_gpu0(f, remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": 1,
                                                             "failure": 0}), "fail", "row remap is pending"),
    ("gpu.ecc_health", lambda f: edit_gpu0(f, remapped_rows={"correctable": 0, "uncorrectable": 9, "pending": 0,
                                                             "failure": 1}), "fail", "row remapping failed"),
    ("gpu.ecc_health", lambda f: edit_gpu0(f, ecc_uncorrected_volatile=3), "fail", "3 uncorrectable"),
    ("gpu.ecc_health", lambda f: edit_gpu0(f, retired_pending=1), "fail", "retired pages"),
    ("gpu.pcie_link", lambda f: edit_gpu0(f, pcie_width=8), "fail", "x8 of x16"),
    ("gpu.pcie_link", lambda f: edit_gpu0(f, pcie_gen=3, util={"gpu": 90, "memory": 40}), "fail", "gen 3 of 5 while busy"),
    ("gpu.clock_events", lambda f: edit_gpu0(f, clock_events=0x40), "fail", "hw_thermal_slowdown"),
    ("gpu.clock_events", lambda f: edit_gpu0(f, clock_events=0x8 | 0x4), "fail", "hw_slowdown"),
    ("gpu.clock_events", lambda f: edit_gpu0(f, clock_events=0x80), "fail", "power_brake"),
    ("gpu.clock_events", lambda f: edit_gpu0(f, clock_events=0x20), "warn", "sw_thermal"),
    ("gpu.mig_mode", lambda f: edit_gpu0(f, mig=[1, 1]), "warn", "MIG is on"),
    ("gpu.mig_mode", lambda f: edit_gpu0(f, mig=[0, 1]), "warn", "waits for a GPU reset"),
    ("gpu.fabric_manager", lambda f: edit(f, "pci.nvidia", f.value("pci.nvidia") + [
        {"bdf": "0000:05:00.0", "class": "0x068000", "kind": "nvswitch", "driver": None}]),
     "fail", "fabric not trained"),
    ("gpu.memory_headroom", lambda f: edit_gpu0(f, memory={"total": 150 * GiB, "free": 100 * GiB, "used": 50 * GiB}),
     "fail", "100.0 GiB free"),
    ("gpu.xid_recent", lambda f: edit(f, "kernel.xid_events", {"uptime_s": 1000.0, "events": [
        {"t_s": 900.0, "pci": "0000:00:06", "xid": 79, "text": "GPU has fallen off the bus."}]}),
     "fail", "Xid 79"),
    ("gpu.xid_recent", lambda f: edit(f, "kernel.xid_events", {"uptime_s": 1000.0, "events": [
        {"t_s": 990.0, "pci": "0000:00:06", "xid": 13, "text": "Graphics Exception"}]}), "warn", "Xid 13"),
    ("kernel.version", lambda f: edit(f, "kernel.release", "5.4.0-150-generic"), "fail", "older than 5.10"),
    ("kernel.version", lambda f: edit(f, "kernel.release", "5.10.0-28-amd64"), "warn", "recommended 5.15"),
    ("kernel.numa_balancing", lambda f: edit(f, "kernel.numa_balancing", 1), "fail", "numa_balancing = 1"),
    ("numa.gpu_affinity", lambda f: edit(edit(f, "numa.nodes", {"0": "0-7", "1": "8-15"}), "pci.nvidia",
                                         [{**f.value("pci.nvidia")[0], "numa_node": -1}]), "warn", "no NUMA node"),
    ("mem.memlock", lambda f: edit(f, "mem.memlock", {"soft": 65536, "hard": 65536}), "warn", "memlock limited"),
    ("mem.transparent_hugepages", lambda f: edit(f, "mm.thp_enabled", "always"), "warn", "always"),
    ("mem.transparent_hugepages", lambda f: edit(f, "mm.thp_defrag", "always"), "warn", "defrag"),
    ("cpu.governor", lambda f: edit(f, "cpu.governors", {"powersave": 12, "performance": 4}), "warn", "powersave"),
]


@pytest.mark.parametrize("cid,broken,status,words", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_check_on_broken_host(cid, broken, status, words):
    r = result(broken(h200()), cid)
    assert (r.status, words in r.message) == (status, True), r.message
    assert r.remediation, "a failing check must say how to fix it"
    assert r.evidence, "a check shows the values it read"


@pytest.mark.parametrize("broken, words", [
    (lambda f: edit(f, "kernel.config", {"CONFIG_IO_URING": "n"}), "CONFIG_IO_URING=n"),
    (lambda f: edit(f, "kernel.io_uring_disabled", 2), "io_uring_disabled = 2"),
    (lambda f: edit(f, "kernel.io_uring_disabled", 1), "io_uring_group"),
])
def test_io_uring_off_is_reported_never_failed(broken, words):
    """zerod uses no io_uring, and a host that disables it does so on purpose: the check
    says so and never fails the preflight gate."""
    r = result(broken(h200()), "kernel.io_uring")
    assert r.status == "pass" and words in r.message, r.message
    assert "zerod does not use io_uring" in r.message
    assert "async model loading" not in r.message


def test_every_check_has_a_failing_case():
    from test_checks_inventory import BROKEN as INVENTORY
    from test_checks_platform import BROKEN as PLATFORM

    covered = {b[0] for b in BROKEN + PLATFORM + INVENTORY} | {"gpu.driver_loaded", "gpu.foreign_processes",
                                                    "net.bind_exposure", "engine.config",  # own snapshots below
                                                    "kernel.io_uring",  # never fails: test below
                                                    "gpu.nvlink", "gpu.p2p"}  # test_checks_links.py
    assert covered == set(CATALOGUE)


def test_idle_link_that_trained_down_is_not_a_failure():
    # The H200 fixture's nvidia-smi showed gen 5 at idle, but many GPUs drop to gen 1 when idle.
    r = result(edit_gpu0(h200(), pcie_gen=1, util={"gpu": 0, "memory": 0}), "gpu.pcie_link")
    assert r.status == "pass" and "idle" in r.message


def test_pcie_falls_back_to_sysfs_when_nvml_lacks_the_link():
    f = edit_gpu0(h200(), pcie_width=None, pcie_width_max=None, pcie_gen=None, pcie_gen_max=None)
    assert result(f, "gpu.pcie_link").status == "pass"
    pci = [{**f.value("pci.nvidia")[0], "current_link_width": "4"}]
    r = result(edit(f, "pci.nvidia", pci), "gpu.pcie_link")
    assert r.status == "fail" and "x4 of x16" in r.message


def test_xid_outside_the_window_is_ignored():
    f = edit(h200(), "kernel.xid_events", {"uptime_s": 100000.0, "events": [
        {"t_s": 10.0, "pci": "0000:00:06", "xid": 79, "text": "long ago"}]})
    assert result(f, "gpu.xid_recent").status == "pass"
    assert result(f, "gpu.xid_recent", DoctorConfig(xid_window_s=200000)).status == "fail"


def test_memory_fraction_above_092_fails():
    r = result(h200(), "gpu.memory_headroom", DoctorConfig(gpu_memory_utilization=0.95))
    assert r.status == "fail" and "0.95 is above 0.92" in r.message


# -- recorded failing snapshots (tests/fixtures/facts/*.json, see make_variants.py) ----------

def test_snapshot_v100():
    s = statuses(load("v100"))
    assert s["gpu.compute_capability"] == s["gpu.driver_version"] == s["gpu.cuda_compat"] == "fail"
    assert s["gpu.mig_mode"] == "pass"  # not supported on a V100: nothing to do
    r = result(load("v100"), "gpu.compute_capability")
    assert "(Tesla V100-SXM2-32GB) is sm_70" in r.message and "Ampere or newer" in r.remediation


def test_snapshot_old_kernel_without_io_uring():
    s = statuses(load("old-kernel"))
    assert s["kernel.version"] == "fail" and s["kernel.io_uring"] == "pass"


def test_snapshot_numa_balancing_and_affinity():
    s = statuses(load("numa-balancing"))
    assert s["kernel.numa_balancing"] == "fail"
    r = result(load("numa-balancing"), "numa.gpu_affinity")
    assert r.status == "fail" and "node 1" in r.message and "CPUs 0-15" in r.message


def test_snapshot_driver_library_mismatch():
    r = result(load("driver-mismatch"), "gpu.driver_loaded")
    assert r.status == "fail"
    assert "driver/library version mismatch" in r.message and "570.86.15" in r.message
    assert "reboot" in r.remediation
    s = statuses(load("driver-mismatch"))
    assert all(s[c] == "fail" for c in CATALOGUE if c.startswith("gpu."))


def test_snapshot_nouveau_bound():
    r = result(load("nouveau"), "gpu.driver_loaded")
    assert r.status == "fail" and "nouveau is bound to 0000:00:06.0" in r.message
    assert "blacklist nouveau" in r.remediation


def test_snapshot_sick_gpu():
    s = statuses(load("sick-gpu"))
    assert s["gpu.ecc_health"] == s["gpu.pcie_link"] == s["gpu.clock_events"] == s["gpu.xid_recent"] == "fail"
    assert s["gpu.persistence_mode"] == s["gpu.mig_mode"] == "warn"
    r = result(load("sick-gpu"), "gpu.xid_recent")
    assert "Xid 79" in r.message and "Xid 48" not in r.message  # 48 is outside the window
    assert "reboot" in r.remediation


def test_snapshot_host_limits():
    s = statuses(load("host-limits"))
    assert s["mem.memlock"] == s["mem.transparent_hugepages"] == s["cpu.governor"] == "warn"
    assert run_checks(load("host-limits")).exit_code == 1


# -- net.bind_exposure (facts + the [engine] bind address and api key) -----------------------

@pytest.mark.parametrize("host,key,status,words", [
    ("127.0.0.1", False, "pass", "loopback"),
    ("localhost", False, "pass", "loopback"),
    ("0.0.0.0", False, "fail", "34.120.10.5"),
    ("0.0.0.0", True, "pass", "API key"),
    ("10.0.0.7", False, "warn", "local network"),
    ("34.120.10.5", False, "fail", "public"),
])
def test_bind_exposure(host, key, status, words):
    cfg = DoctorConfig.from_dict({}, engine={"host": host, "api_key": "k" if key else None})
    r = result(load("host-limits"), "net.bind_exposure", cfg)
    assert r.status == status and words in r.message, r.message


def test_bind_exposure_without_netlink_says_why():
    f = edit(h200(), "net.addresses", error="netlink: [Errno 97] Address family not supported")
    r = result(f, "net.bind_exposure", DoctorConfig(bind_address="0.0.0.0"))
    assert r.status == "warn" and "could not be read" in r.message and "netlink" in r.message


# -- engine.config ------------------------------------------------------------------------------

def _model(tmp_path, layers=32, kv_heads=8, head_dim=128, weights=16 * GiB, max_pos=8192):
    import json

    from zerod.engine.demo import write_tokenizer

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": kv_heads, "hidden_size": 32 * head_dim, "max_position_embeddings": max_pos,
        "intermediate_size": 32 * head_dim, "vocab_size": 32000, "torch_dtype": "bfloat16"}))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weights)  # sparse: doctor reads no weights
    write_tokenizer(d)
    return str(d)


def test_engine_config_fits_and_not(tmp_path):
    from zerod.checks import probe_model

    path = _model(tmp_path)
    f = h200()
    probe_model.probe(f, path)
    r = result(f, "engine.config", DoctorConfig(model=path))
    assert r.status == "pass" and "KV room for" in r.message
    small = edit_gpu0(f, memory={"total": 24 * GiB, "free": 24 * GiB, "used": 0})
    r = result(small, "engine.config", DoctorConfig(model=path, max_model_len=131072))
    assert r.status == "fail" and "131072-token" in r.message
    r = result(f, "engine.config", DoctorConfig(model=path, max_model_len=16384))
    assert r.status == "warn" and "exceeds the model's 8192" in r.message


def test_engine_config_missing_model(tmp_path):
    from zerod.checks import probe_model

    f = h200()
    probe_model.probe(f, str(tmp_path / "nope"))
    r = result(f, "engine.config")
    assert r.status == "fail" and "does not exist" in r.message
    assert result(h200(), "engine.config").status == "skip"  # nothing configured


# -- errors, skips, waivers, selection -----------------------------------------------------------

def test_a_check_that_raises_becomes_error_and_the_others_run():
    f = edit_gpu0(h200(), cc="garbage")
    report = run_checks(f)
    by = {c.id: c for c in report.checks}
    assert by["gpu.compute_capability"].status == "error"
    assert "raised" in by["gpu.compute_capability"].message
    assert sum(c.status == "pass" for c in report.checks) >= 18
    assert report.exit_code == 1


def test_missing_file_skips_and_unreadable_file_errors():
    f = edit(h200(), "kernel.numa_balancing", error="/proc/sys/kernel/numa_balancing does not exist", missing=True)
    r = result(f, "kernel.numa_balancing")
    assert r.status == "skip" and "does not exist" in r.message
    f = edit(h200(), "kernel.numa_balancing", error="/proc/sys/kernel/numa_balancing is not readable (permission denied)")
    r = result(f, "kernel.numa_balancing")
    assert r.status == "error" and "permission denied" in r.message and r.remediation


def test_waiver_turns_a_failure_into_a_skip_with_the_reason():
    f = load("numa-balancing")
    cfg = DoctorConfig.from_dict({"waivers": {"kernel.numa_balancing": "single-socket test box",
                                              "numa.gpu_affinity": "pinned by hand"}})
    report = run_checks(f, cfg)
    r = {c.id: c for c in report.checks}["kernel.numa_balancing"]
    assert r.status == "skip" and "waived (single-socket test box)" in r.message and "found fail" in r.message
    assert report.exit_code == 0
    assert report.to_dict()["summary"]["waived"] == {"kernel.numa_balancing": "single-socket test box",
                                                     "numa.gpu_affinity": "pinned by hand"}


def test_only_and_skip_take_ids_areas_and_globs():
    assert set(statuses(h200(), only=["kernel"])) == {"kernel.version", "kernel.io_uring", "kernel.numa_balancing"}
    assert set(statuses(h200(), only=["gpu.pcie_link", "mem.*"])) == {
        "gpu.pcie_link", "mem.memlock", "mem.transparent_hugepages", "mem.swap"}
    assert "gpu.xid_recent" not in statuses(h200(), skip=["gpu.xid_recent"])
    with pytest.raises(ValueError, match="no check matches"):
        run_checks(h200(), only=["gpu.nope"])


def test_report_dict_shape():
    d = run_checks(load("sick-gpu")).to_dict()
    assert set(d) == {"version", "host", "checks", "summary"}
    for c in d["checks"]:
        assert {"id", "title", "status", "severity", "evidence", "remediation"} <= set(c)
        assert c["status"] in STATUSES
    assert d["summary"]["exit_code"] == 2 and d["summary"]["total"] == len(d["checks"])


def test_config_validation():
    from zerod.checks import DoctorConfigError

    with pytest.raises(DoctorConfigError, match="unknown key"):
        DoctorConfig.from_dict({"max_memory_fractoin": 0.9})
    with pytest.raises(DoctorConfigError, match="needs a reason"):
        DoctorConfig.from_dict({"waivers": {"gpu.mig_mode": ""}})
    with pytest.raises(DoctorConfigError, match="gpu_memory_utilization"):
        DoctorConfig.from_dict({}, engine={"gpu_memory_utilization": 1.5})
    cfg = DoctorConfig.from_config({"doctor": {"allowed_gpu_processes": "nv-hostengine"},
                                    "engine": {"host": "0.0.0.0", "api_key": "s3cret", "model": "demo"}})
    assert cfg.allowed_gpu_processes == ("nv-hostengine",)
    assert (cfg.bind_address, cfg.api_key_set, cfg.model) == ("0.0.0.0", True, "demo")
