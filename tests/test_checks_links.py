"""gpu.nvlink and gpu.p2p on the 2-GPU H200 machine's snapshot (tests/fixtures/facts/h200x2.json,
from tests/fixtures/h200x2/) and on what a broken one would read instead."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from test_checks_helpers import edit, h200, load, result
from zerod.checks import DoctorConfig
from zerod.checks.facts import Facts, Roots
from zerod.checks import probe_links


def x2() -> Facts:
    return load("h200x2")


def with_links(facts: Facts, change) -> Facts:
    nv = copy.deepcopy(facts.value("nvml.nvlink"))
    change(nv["gpus"])
    return edit(facts, "nvml.nvlink", nv)


def test_the_healthy_two_gpu_host_passes_though_its_crc_counters_are_not_zero():
    r = result(x2(), "gpu.nvlink")
    assert r.status == "pass", r.message
    assert "18 NVLinks each, all up (far end: NVSwitch)" in r.message and "not rising" in r.message
    assert any(e["name"] == "nvml.nvlink" for e in r.evidence)
    p = result(x2(), "gpu.p2p")
    assert (p.status, p.message) == ("pass", "peer access OK both ways between GPUs 0, 1 (over NVLink)")


def test_one_gpu_skips_with_its_reason():
    for cid in ("gpu.nvlink", "gpu.p2p"):
        r = result(h200(), cid)
        assert (r.status, r.message) == ("skip", "one GPU (GPU 0): no peer to link to")
        r = result(x2(), cid, DoctorConfig(gpus=(1,)))  # an engine of one GPU on a 2-GPU host
        assert (r.status, r.message) == ("skip", "one GPU (GPU 1): no peer to link to")


def test_a_link_down_fails():
    facts = with_links(x2(), lambda gpus: gpus[1]["links"][5].update(state=0))
    r = result(facts, "gpu.nvlink")
    assert r.status == "fail" and "GPU 1: link 5 down (17 of 18 up)" in r.message
    assert "nvidia-smi nvlink" in r.remediation


def test_rising_crc_counters_warn_and_rising_recoveries_fail():
    def crc(gpus):
        gpus[0]["links"][3]["errors_again"]["crc_data"] += 40

    r = result(with_links(x2(), crc), "gpu.nvlink")
    assert r.status == "warn" and "GPU 0 link 3: crc_data +40" in r.message

    def recovery(gpus):
        gpus[1]["links"][0]["errors_again"]["recovery"] += 1

    r = result(with_links(x2(), recovery), "gpu.nvlink")
    assert r.status == "fail" and "GPU 1 link 0: recovery +1" in r.message


def test_p2p_blocked_names_the_path_and_the_iommu():
    p2p = copy.deepcopy(x2().value("nvml.p2p"))
    p2p["0-1"].update(read=3, write=3, nvlink=5, topology=50)
    facts = edit(edit(x2(), "nvml.p2p", p2p), "iommu", {"units": ["dmar0"], "cmdline": ["intel_iommu=on"]})
    r = result(facts, "gpu.p2p")
    assert r.status == "fail"
    assert ("GPU 0 -> GPU 1: read IOH topology not supported, write IOH topology not supported "
            "(through the CPU interconnect between NUMA nodes)") in r.message
    assert "an IOMMU translates DMA (dmar0, no iommu=pt" in r.message
    assert "iommu=pt" in r.remediation and "ACS" in r.remediation


def test_nccl_p2p_disable_in_the_engine_environment_is_named():
    r = result(x2(), "gpu.p2p", DoctorConfig(engine_env={"NCCL_P2P_DISABLE": "1"}))
    assert r.status == "fail" and r.message.startswith("NCCL_P2P_DISABLE=1 in the engine's environment")
    assert "remove NCCL_P2P_DISABLE" in r.remediation
    r = result(edit(x2(), "env.nccl", {"NCCL_P2P_LEVEL": "LOC"}), "gpu.p2p")
    assert r.status == "fail" and "NCCL_P2P_LEVEL=LOC" in r.message
    assert result(x2(), "gpu.p2p", DoctorConfig(engine_env={"NCCL_P2P_DISABLE": "0"})).status == "pass"


def test_engine_env_comes_from_the_daemon_table():
    cfg = DoctorConfig.from_config({"daemon": {"engine_env": {"NCCL_P2P_DISABLE": "1"}}})
    assert cfg.engine_env == {"NCCL_P2P_DISABLE": "1"}


class FakeNvml:
    """pynvml as the 2-GPU machine answered, with counters that move between reads."""

    class NVMLError(Exception):
        pass

    def __init__(self, nvml_fixture: dict, crc_step: int = 0) -> None:
        self.fx, self.crc_step, self.reads = nvml_fixture, crc_step, {}

    def nvmlDeviceGetCount(self):
        return len(self.fx["gpus"])

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = self.fx["gpus"][h]["nvlink"]
        if link >= len(links):
            raise self.NVMLError("Not Supported")
        return links[link]["state"]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self.fx["gpus"][h]["nvlink"][link]["remote"].encode())

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        name = {v: k for k, v in probe_links.ERROR_COUNTERS.items()}[counter]
        n = self.reads[(h, link, counter)] = self.reads.get((h, link, counter), -1) + 1
        return self.fx["gpus"][h]["nvlink"][link]["errors"][name] + (self.crc_step * n if name == "crc_data" else 0)

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        name = {v: k for k, v in probe_links.P2P_CAPS.items()}[cap]
        return self.fx["p2p"][f"{a}-{b}"][name]

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.fx["p2p"][f"{a}-{b}"]["topology"]


def probed(monkeypatch, tmp_path, nvml) -> Facts:
    from zerod.checks import probe_nvml

    monkeypatch.setattr(probe_nvml, "session", lambda: nvml)
    monkeypatch.setattr(probe_links, "READ_GAP_S", 0.0)
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz intel_iommu=on quiet\n")
    (tmp_path / "sys/class/iommu/dmar0").mkdir(parents=True, exist_ok=True)
    facts = x2()
    for key in ("nvml.nvlink", "nvml.p2p", "iommu", "env.nccl"):
        facts.items.pop(key, None)
    probe_links.probe(facts, Roots.make(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys")))
    return facts


def test_the_probe_reads_nvml_as_the_checks_expect(monkeypatch, tmp_path):
    import json
    from pathlib import Path

    fx = json.loads((Path(__file__).parent / "fixtures/h200x2/p2p_nvlink.json").read_text())
    facts = probed(monkeypatch, tmp_path, FakeNvml(fx))
    assert facts.value("iommu") == {"units": ["dmar0"], "cmdline": ["intel_iommu=on"]}
    assert facts.value("nvml.nvlink")["gpus"][0]["links"][0] == {
        "link": 0, "state": 1, "remote": "ffffffff:ff:ff.0",
        "errors": {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 7},
        "errors_again": {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 7}}
    assert result(facts, "gpu.nvlink").status == "pass" and result(facts, "gpu.p2p").status == "pass"
    facts = probed(monkeypatch, tmp_path, FakeNvml(fx, crc_step=2))  # CRC errors arriving while it reads
    r = result(facts, "gpu.nvlink")
    assert r.status == "warn" and "GPU 0 link 0: crc_data +2" in r.message
