"""NVML GPM metrics (SM activity and occupancy, tensor-pipe activity, DRAM bandwidth)
and the memory-copy utilization on /metrics and /v1/gpus, from a fake pynvml shaped
like the bindings: GPU 0 supports GPM (a Hopper), GPU 1 does not; every GPM sample
but the one kept for the next interval is freed."""

from __future__ import annotations

import types

from test_daemon_metrics import _views  # same folder
from test_daemon_watchers import fake_nvml
from zerod.daemon_config import DaemonConfig
from zerod.daemon_metrics import make_registry, render
from zerod.watchers.nvml_gpm import GpmWatcher
from zerod.watchers.nvml_session import NvmlSession

PERCENT = {2: 71.5, 3: 40.25, 5: 33.0, 10: 88.0}  # metric id -> what the driver answers


def gpm_nvml():
    N = fake_nvml(2)
    N.live_samples = set()
    N.NVML_GPM_METRICS_GET_VERSION = 1
    N.NVML_GPM_METRIC_SM_UTIL, N.NVML_GPM_METRIC_SM_OCCUPANCY = 2, 3
    N.NVML_GPM_METRIC_ANY_TENSOR_UTIL, N.NVML_GPM_METRIC_DRAM_BW_UTIL = 5, 10
    N.nvmlDeviceGetUtilizationRates = lambda g: types.SimpleNamespace(gpu=g["util"], memory=37)
    N.nvmlGpmQueryDeviceSupport = lambda g: types.SimpleNamespace(isSupportedDevice=int(N.gpus.index(g) == 0))
    counter = iter(range(1000))

    def alloc():
        s = next(counter)
        N.live_samples.add(s)
        return s

    N.nvmlGpmSampleAlloc = alloc
    N.nvmlGpmSampleFree = lambda s: N.live_samples.remove(s)
    N.nvmlGpmSampleGet = lambda g, s: s

    class MetricsGet:
        def __init__(self):
            self.metrics = [types.SimpleNamespace(metricId=0, nvmlReturn=None, value=0.0) for _ in range(98)]

    def metrics_get(mg):
        assert mg.version == 1 and mg.sample1 < mg.sample2 and mg.numMetrics == 4
        for m in mg.metrics[:mg.numMetrics]:
            m.nvmlReturn, m.value = (0, PERCENT[m.metricId]) if m.metricId in PERCENT else (3, 0.0)
        return mg

    N.c_nvmlGpmMetricsGet_t = MetricsGet
    N.nvmlGpmMetricsGet = metrics_get
    return N


def test_gpm_ratios_where_supported_and_memory_copy_utilization():
    N = gpm_nvml()
    views = _views(N)
    gpm = GpmWatcher(views.nvml_stats.session, DaemonConfig.from_dict({}))
    views.gpm = gpm
    views.watchers.append(gpm)
    gpm.poll()
    assert gpm.snapshot(0) == dict.fromkeys(("sm_activity_ratio", "sm_occupancy_ratio", "tensor_pipe_activity_ratio",
                                             "dram_bandwidth_utilization_ratio"))  # one sample: no interval yet
    gpm.poll()
    gpm.poll()
    assert gpm.snapshot(0) == {"sm_activity_ratio": 0.715, "sm_occupancy_ratio": 0.4025,
                               "tensor_pipe_activity_ratio": 0.33, "dram_bandwidth_utilization_ratio": 0.88}
    assert len(N.live_samples) == 1  # only GPU 0's latest sample is held
    text = render(make_registry(views)).decode()
    assert 'zerod_gpu_sm_activity_ratio{gpu="0",uuid="GPU-0000"} 0.715' in text
    assert 'zerod_gpu_tensor_pipe_activity_ratio{gpu="0",uuid="GPU-0000"} 0.33' in text
    assert 'zerod_gpu_dram_bandwidth_utilization_ratio{gpu="0",uuid="GPU-0000"} 0.88' in text
    assert 'zerod_gpu_gpm_supported{gpu="1",uuid="GPU-0001"} 0.0' in text
    assert 'zerod_gpu_sm_activity_ratio{gpu="1"' not in text
    assert 'zerod_gpu_memory_copy_utilization_ratio{gpu="1",uuid="GPU-0001"} 0.37' in text
    rows = {g["index"]: g for g in views.gpus()["gpus"]}
    assert rows[0]["sm_occupancy_ratio"] == 0.4025 and rows[1]["sm_occupancy_ratio"] is None
    assert rows[0]["memory_copy_utilization_ratio"] == 0.37


def test_bindings_without_gpm_export_nothing_but_the_flag():
    N = fake_nvml(1)
    gpm = GpmWatcher(NvmlSession(N), DaemonConfig.from_dict({}))
    gpm.poll()
    gpm.poll()
    names = [f.name for f in gpm.collect() if f.samples]
    assert names == ["zerod_gpu_gpm_supported"] and gpm.snapshot(0)["sm_activity_ratio"] is None
