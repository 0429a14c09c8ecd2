"""NVML GPM (GPU performance monitoring) metrics, what dcgm-exporter's profiling
fields report: SM activity, SM occupancy, tensor-pipe activity and DRAM bandwidth
utilization, each a ratio over the last interval between two GPM samples.

GPM exists on Hopper and newer (nvmlGpmQueryDeviceSupport says); elsewhere, or
with a driver or nvidia-ml-py without it, the GPU gets no such series and its
`zerod_gpu_gpm_supported` is 0. Samples are read from the driver without a CUDA
context and without DCGM's profiling module.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from zerod.daemon_config import DaemonConfig
from zerod.registry import owns
from zerod.watchers import Watcher
from zerod.watchers.nvml_session import NvmlSession

log = logging.getLogger("zerod.gpm")

# (key of the GPU row, NVML constant name, metric, help); GPM answers percentages
GPM_METRICS = (
    ("sm_activity_ratio", "NVML_GPM_METRIC_SM_UTIL", "zerod_gpu_sm_activity_ratio",
     "Share of SMs busy over the last interval (NVML GPM; DCGM_FI_PROF_SM_ACTIVE)."),
    ("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY", "zerod_gpu_sm_occupancy_ratio",
     "Warps resident against the SMs' maximum over the last interval (NVML GPM; DCGM_FI_PROF_SM_OCCUPANCY)."),
    ("tensor_pipe_activity_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", "zerod_gpu_tensor_pipe_activity_ratio",
     "Share of time the SMs ran any tensor-core work (NVML GPM; DCGM_FI_PROF_PIPE_TENSOR_ACTIVE)."),
    ("dram_bandwidth_utilization_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL", "zerod_gpu_dram_bandwidth_utilization_ratio",
     "DRAM bandwidth used against its maximum over the last interval (NVML GPM; DCGM_FI_PROF_DRAM_ACTIVE)."),
)
KEYS = tuple(k for k, _, _, _ in GPM_METRICS)


@owns(metrics=("zerod_gpu_gpm_supported", *(metric for _, _, metric, _ in GPM_METRICS)))
class GpmWatcher(Watcher):
    name = "nvml_gpm"

    def __init__(self, session: NvmlSession, cfg: DaemonConfig) -> None:
        super().__init__()
        self.session = session
        self.interval_s = cfg.watch_interval_s
        self.supported: dict[int, bool] = {}
        self.values: dict[int, dict[str, float | None]] = {}
        self._uuid: dict[int, str] = {}
        self._prev: dict[int, Any] = {}  # the last GPM sample per GPU
        self._generation = -1

    def poll(self) -> None:
        if not self.session.ensure():
            return
        N = self.session.nvml
        if self.session.generation != self._generation:  # handles from an earlier session are stale
            self._generation = self.session.generation
            self._prev.clear()
            self.supported.clear()
            self.values.clear()
        for dev in list(self.session.devices):
            if dev.index in self.session.lost:
                continue
            self._uuid[dev.index] = dev.uuid
            if dev.index not in self.supported:
                self.supported[dev.index] = _supported(N, dev.handle)
            if self.supported[dev.index]:
                self._sample(N, dev)

    def _sample(self, N, dev) -> None:
        sample = N.nvmlGpmSampleAlloc()
        try:
            N.nvmlGpmSampleGet(dev.handle, sample)
        except Exception:
            N.nvmlGpmSampleFree(sample)
            raise
        prev, self._prev[dev.index] = self._prev.get(dev.index), sample
        if prev is None:
            return
        try:
            self.values[dev.index] = _metrics(N, prev, sample)
        finally:
            N.nvmlGpmSampleFree(prev)

    def snapshot(self, gpu: int) -> dict[str, float | None]:
        """The GPU row's GPM fields for /v1/gpus; each null when not measured."""
        got = self.values.get(gpu, {})
        return {k: got.get(k) for k in KEYS}

    def collect(self):
        labels = ["gpu", "uuid"]
        fams = {key: GaugeMetricFamily(metric, doc, labels=labels) for key, _, metric, doc in GPM_METRICS}
        sup = GaugeMetricFamily("zerod_gpu_gpm_supported",
                                "1 when the GPU reports NVML GPM metrics (Hopper and newer).", labels=labels)
        for gpu in sorted(self.supported):
            lv = [str(gpu), self._uuid.get(gpu, "")]
            sup.add_metric(lv, 1.0 if self.supported[gpu] else 0.0)
            for key, value in self.values.get(gpu, {}).items():
                if value is not None:
                    fams[key].add_metric(lv, value)
        yield sup
        yield from fams.values()


def _supported(N, handle) -> bool:
    fn = getattr(N, "nvmlGpmQueryDeviceSupport", None)
    if fn is None:
        return False  # an nvidia-ml-py without GPM
    try:
        return bool(fn(handle).isSupportedDevice)
    except Exception:  # noqa: BLE001 - a driver without GPM answers an error: no GPM here
        return False


def _metrics(N, s1, s2) -> dict[str, float | None]:
    mg = N.c_nvmlGpmMetricsGet_t()
    mg.version = N.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(GPM_METRICS)
    mg.sample1, mg.sample2 = s1, s2
    for i, (_, const, _, _) in enumerate(GPM_METRICS):
        mg.metrics[i].metricId = getattr(N, const)
    N.nvmlGpmMetricsGet(mg)
    out: dict[str, float | None] = {}
    for i, (key, _, _, _) in enumerate(GPM_METRICS):
        m = mg.metrics[i]
        out[key] = round(float(m.value) / 100.0, 4) if m.nvmlReturn == 0 else None
    return out
