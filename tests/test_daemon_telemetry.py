"""Telemetry parity with dcgm-exporter: HBM temperature, memory clock, energy,
NVLink throughput and errors, remapped rows, compute mode, per-process SM and
memory utilization, MIG instances — from a fake pynvml shaped like the real
bindings' answers (nvmlFieldValue_t rows, process-utilization samples); calls
a GPU does not support are skipped once and logged once; promtool passes."""

from __future__ import annotations

import logging
import shutil
import subprocess
import types

import pytest

from test_daemon_metrics import _views  # same folder
from test_daemon_watchers import NVMLError, fake_nvml
from zerod.daemon_metrics import make_registry, render

ALL_LINKS = 0xFFFFFFFF


def parity_nvml():
    """GPU 0: an SXM H200 (NVLink, HBM sensor, MIG off); GPU 1: a PCIe board whose
    driver supports neither NVLink fields nor process utilization, with MIG on."""
    N = fake_nvml(2)
    calls = {"fields": [0, 0], "putil": [0, 0]}
    N.calls = calls
    field_data = {0: {82: 45, 138: 2_000_000, 139: 1_000_000, 38: 3, 45: 0, 52: 1, 59: 0}, 1: {82: 51}}

    def fields(g, ids):
        i = N.gpus.index(g)
        calls["fields"][i] += 1
        out = []
        for fid, scope in ids:
            assert scope == (ALL_LINKS if fid in (138, 139) else 0)
            v = field_data[i].get(fid)
            out.append(types.SimpleNamespace(fieldId=fid, nvmlReturn=0 if v is not None else 3, valueType=3,
                                             value=types.SimpleNamespace(ullVal=v or 0)))
        return out

    def putil(g, since):
        i = N.gpus.index(g)
        calls["putil"][i] += 1
        if i == 1:
            raise NVMLError(3)  # NOT_SUPPORTED
        return [types.SimpleNamespace(pid=2211, timeStamp=since + 10, smUtil=37, memUtil=12, encUtil=0, decUtil=0),
                types.SimpleNamespace(pid=4242, timeStamp=since + 20, smUtil=40, memUtil=20, encUtil=0, decUtil=0)]

    mig = types.SimpleNamespace(parent=1)
    N.nvmlDeviceGetFieldValues = fields
    N.nvmlDeviceGetProcessUtilization = putil
    N.nvmlDeviceGetTotalEnergyConsumption = lambda g: 123_456_789  # mJ
    N.nvmlDeviceGetComputeMode = lambda g: 3 if N.gpus.index(g) == 0 else 0
    N.nvmlDeviceGetMigMode = lambda g: (0, 0) if N.gpus.index(g) == 0 else (1, 1)
    N.nvmlDeviceGetMaxMigDeviceCount = lambda g: 2

    def mig_handle(g, i):
        if i == 1:
            raise NVMLError(6)  # NOT_FOUND: an empty slot
        return mig

    real_mem = N.nvmlDeviceGetMemoryInfo
    N.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    N.nvmlDeviceGetMemoryInfo = lambda g: types.SimpleNamespace(used=5 << 30, total=35 << 30) if g is mig \
        else real_mem(g)
    real_uuid = N.nvmlDeviceGetUUID
    N.nvmlDeviceGetUUID = lambda g: "MIG-0001" if g is mig else real_uuid(g)
    N.nvmlDeviceGetGpuInstanceId = lambda g: 1
    N.nvmlDeviceGetComputeInstanceId = lambda g: 0
    return N


def test_dcgm_exporter_parity_series():
    N = parity_nvml()
    v = _views(N)
    text = render(make_registry(v)).decode()
    expected = [
        'zerod_gpu_memory_clock_hertz{gpu="0",uuid="GPU-0000"} 3.201e+09',
        'zerod_gpu_memory_temperature_celsius{gpu="0",uuid="GPU-0000"} 45.0',
        'zerod_gpu_memory_temperature_celsius{gpu="1",uuid="GPU-0001"} 51.0',
        'zerod_gpu_energy_joules_total{gpu="0",uuid="GPU-0000"} 123456.789',
        'zerod_gpu_compute_mode{gpu="0",uuid="GPU-0000"} 3.0',
        'zerod_gpu_remapped_rows{cause="correctable",gpu="0",uuid="GPU-0000"} 0.0',
        'zerod_gpu_row_remap_pending{gpu="0",uuid="GPU-0000"} 0.0',
        'zerod_gpu_row_remap_failed{gpu="0",uuid="GPU-0000"} 0.0',
        'zerod_gpu_nvlink_bytes_total{direction="tx",gpu="0",uuid="GPU-0000"} 2.048e+09',
        'zerod_gpu_nvlink_errors_total{gpu="0",type="crc_flit",uuid="GPU-0000"} 3.0',
        'zerod_gpu_nvlink_errors_total{gpu="0",type="replay",uuid="GPU-0000"} 1.0',
        'zerod_gpu_mig_enabled{gpu="0",uuid="GPU-0000"} 0.0',
        'zerod_gpu_mig_enabled{gpu="1",uuid="GPU-0001"} 1.0',
        'zerod_gpu_mig_memory_used_bytes{compute_instance="0",gpu="1",gpu_instance="1",uuid="GPU-0001"} 5.36870912e+09',
        # per process, by role and name: the foreign dcgm-exporter of the recorded rows; never a pid
        'zerod_gpu_process_sm_utilization_ratio{gpu="0",process="dcgm-exporter",role="foreign",uuid="GPU-0000"} 0.37',
        'zerod_gpu_process_sm_utilization_ratio{gpu="0",process="?",role="unlisted",uuid="GPU-0000"} 0.4',
    ]
    for line in expected:
        assert line in text, line
    assert "nvlink" not in "".join(x for x in text.splitlines() if 'gpu="1"' in x)  # no NVLink on the PCIe board
    assert "pid=" not in text
    # per process in /v1/processes; NVLink and MIG in /v1/gpus
    [row] = v.processes_doc()["processes"]
    assert row["sm_utilization_ratio"] == 0.37 and row["memory_utilization_ratio"] == 0.12
    g0, g1 = v.gpus()["gpus"]
    assert g0["nvlink"]["rx_bytes_total"] == 1_024_000_000 and g1["nvlink"] is None
    assert g1["mig_instances"] == [{"uuid": "MIG-0001", "gpu_instance": 1, "compute_instance": 0,
                                    "memory_used_bytes": 5 << 30, "memory_total_bytes": 35 << 30}]
    assert g0["compute_mode"] == "Exclusive_Process" and g0["energy_joules_total"] == pytest.approx(123456.789)


def test_unsupported_calls_are_skipped_for_that_gpu_and_logged_once(caplog):
    caplog.set_level(logging.INFO, "zerod.nvml")
    N = parity_nvml()
    v = _views(N)
    for _ in range(5):
        v.nvml_stats.poll()
    assert N.calls["putil"] == [6, 1]  # GPU 1 said NOT_SUPPORTED once: never asked again
    skipped = v.nvml_stats.reader.unsupported[1]
    assert "nvmlDeviceGetProcessUtilization" in skipped and "field nvlink_tx_kib" in skipped
    assert "field memory_temperature_celsius" not in skipped
    said = [r.message for r in caplog.records if "nvmlDeviceGetProcessUtilization" in r.message]
    assert said == ["GPU 1: nvmlDeviceGetProcessUtilization is not supported by this GPU or driver; not read again"]
    assert v.nvml_stats.gpus[1].memory_temperature_celsius == 51


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_parity_series():
    text = render(make_registry(_views(parity_nvml()))).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
