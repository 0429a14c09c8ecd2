"""The one GPU reading layer (zerod.checks.gpu_reading): doctor's facts and the
daemon's /v1/gpus read the same quantities through it, so they agree."""

from __future__ import annotations

import pytest

from test_daemon_watchers import cfg, fake_nvml  # same folder
from zerod.alerts import AlertBook
from zerod.checks import probe_nvml
from zerod.checks.clock_events import CLOCK_EVENT_REASONS
from zerod.checks.gpu_reading import GpuReading, NvmlReader, read_gpus
from zerod.watchers.nvml_session import NvmlSession
from zerod.watchers.nvml_stats import NvmlStatsWatcher


def sick_nvml():
    return fake_nvml(2, temp=83, power_mw=612_345, ecc=4, remap=(2, 1, 1, 0), replays=17, reasons=0x4 | 0x40,
                     util=37, used=5 << 30)


def test_doctor_and_daemon_report_the_same_quantities():
    N = sick_nvml()
    w = NvmlStatsWatcher(NvmlSession(N), AlertBook(), cfg())
    w.poll()
    for row in w.snapshot()["gpus"]:
        fact = probe_nvml._gpu(N, row["index"])
        assert fact["temperature_c"] == row["temperature_celsius"] == 83
        assert fact["power_w"] == row["power_watts"] == pytest.approx(612.345)
        assert fact["ecc_uncorrected_volatile"] == row["ecc_volatile_uncorrected"] == 4
        assert fact["pcie_replay"] == row["pcie_replays_total"] == 17
        assert fact["memory"]["used"] == row["memory_used_bytes"] == 5 << 30
        assert fact["util"]["gpu"] == round(row["utilization_ratio"] * 100) == 37
        assert fact["remapped_rows"] == {"correctable": 2, "uncorrectable": 1, "pending": True, "failure": False}
        assert row["remapped_rows"] == {"corrected": 2, "uncorrected": 1, "pending": True, "failure": False}
        assert row["clock_events_active"] == ["sw_power_cap", "hw_thermal_slowdown"]
        assert fact["clock_events"] == 0x4 | 0x40


def test_a_reading_is_typed_with_units_in_its_names():
    (g0, g1) = read_gpus(sick_nvml())
    assert isinstance(g0, GpuReading) and (g0.index, g1.index) == (0, 1)
    assert (g0.uuid, g0.name) == ("GPU-0000", "NVIDIA H200")
    assert g0.power_watts == pytest.approx(612.345) and g0.power_limit_watts == pytest.approx(700.0)
    assert g0.memory_total_bytes == 141 << 30 and g0.memory_free_bytes == (141 - 5) << 30
    assert g0.utilization_ratio == pytest.approx(0.37)
    assert g0.remapped_rows.uncorrected == 1 and g0.remapped_rows.pending is True
    # what the fake does not offer is None, with the reason named
    assert g0.energy_joules_total is None
    assert "nvmlDeviceGetTotalEnergyConsumption" in g0.errors["energy_joules_total"]


def test_a_lost_gpu_raises_for_the_daemon_and_is_recorded_for_doctor():
    N = fake_nvml(1, lost=True)
    with pytest.raises(N.NVMLError):
        NvmlReader(N).read(0, N.gpus[0])
    g = NvmlReader(N, lost_raises=False).read(0, N.gpus[0])
    assert g.temperature_celsius is None and g.errors["temperature_celsius"] == "NVML error 15"
    assert probe_nvml._gpu(N, 0)["errors"]["temperature_c"] == "NVML error 15"


def test_an_unsupported_call_is_asked_once_per_gpu():
    N = fake_nvml(1, remap=None)  # nvmlDeviceGetRemappedRows: NOT_SUPPORTED
    asked = []
    real = N.nvmlDeviceGetRemappedRows
    N.nvmlDeviceGetRemappedRows = lambda h: asked.append(h) or real(h)
    r = NvmlReader(N)
    for _ in range(3):
        g = r.read(0, N.gpus[0])
    assert len(asked) == 1 and g.remapped_rows is None and "not supported" in g.errors["remapped_rows"]


def test_doctor_and_daemon_say_alike_why_nvml_cannot_start():
    N = fake_nvml(1)
    N.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    s = NvmlSession(N, retry_s=0)
    assert not s.ensure()
    assert s.error == "no NVIDIA driver found: the nvidia kernel module is not loaded"
    from zerod.checks.gpu_reading import explain_init_error

    assert explain_init_error(N.NVMLError(9)) == ("no_driver", s.error)


@pytest.mark.gpu
def test_on_a_real_gpu_doctor_and_the_daemon_read_the_same_gpu():
    pynvml = pytest.importorskip("pynvml")
    N = probe_nvml.session()
    readings = read_gpus(N)
    assert len(readings) == N.nvmlDeviceGetCount() >= 1
    w = NvmlStatsWatcher(NvmlSession(pynvml), AlertBook(), cfg())
    w.poll()
    rows = {r["index"]: r for r in w.snapshot()["gpus"]}
    for g in readings:
        fact = probe_nvml._gpu(N, g.index)
        row = rows[g.index]
        assert g.uuid == fact["uuid"] == row["uuid"] and g.name == fact["name"] == row["name"]
        assert g.memory_total_bytes == fact["memory"]["total"] == row["memory_total_bytes"] > 0
        assert 0 < g.temperature_celsius < 110 and 0 < g.power_watts <= g.power_limit_watts * 1.5
        assert g.ecc_volatile_uncorrected == fact["ecc_uncorrected_volatile"] == row["ecc_volatile_uncorrected"]
        assert g.compute_mode == fact["compute_mode"]
        # clock reasons change between two reads: both name them from the one table
        assert set(g.clock_events_active) <= set(CLOCK_EVENT_REASONS.values())
