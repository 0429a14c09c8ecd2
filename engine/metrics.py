"""The engine's Prometheus registry (names in DESIGN.md).

Gauges and the allocator / stream-error counters are collected at scrape time from the
engine (a custom collector reading its cached state); histograms and token / request
counters are observed by the output poller as tokens arrive.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
        0.75, 1.0, 2.5, 5.0, 10.0)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_STEP = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot()
        for name, doc in (("requests_running", "Requests being decoded or prefilled."),
                          ("requests_waiting", "Requests in the wait line."),
                          ("kv_pages_free", "KV pages free now.")):
            yield GaugeMetricFamily(f"zerod_engine_{name}", doc, value=s[name])
        # The DESIGN name ends in _total, which promtool accepts only on counters; the pool's
        # size never changes while the engine lives, so a (constant) counter it is.
        yield CounterMetricFamily("zerod_engine_kv_pages", "KV pages a request can get (the pool's size).",
                                  value=s["kv_pages_total"])
        yield CounterMetricFamily("zerod_engine_allocator_retries",
                                  "torch CUDA caching allocator retries (num_alloc_retries); 0 on CPU.",
                                  value=s["allocator_retries"])
        yield CounterMetricFamily("zerod_engine_allocator_ooms",
                                  "torch CUDA caching allocator out-of-memory errors (num_ooms); 0 on CPU.",
                                  value=s["allocator_ooms"])
        yield CounterMetricFamily("zerod_engine_stream_errors",
                                  "CUDA errors surfaced by an event or stream query (other than not-ready).",
                                  value=s["stream_errors"])


class EngineMetrics:
    def __init__(self, snapshot: Callable[[], dict]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("zerod_engine_time_to_first_token_seconds",
                              "Time from submit to the first token.", buckets=_LAT + (20.0, 60.0), registry=r)
        self.itl = Histogram("zerod_engine_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request.", buckets=_LAT, registry=r)
        self.e2e = Histogram("zerod_engine_e2e_request_latency_seconds",
                             "Time from submit to the end of a request.", buckets=_E2E, registry=r)
        self.step_seconds = Histogram("zerod_engine_step_seconds",
                                      "Device time of one engine step (prefill chunks + one decode).",
                                      buckets=_STEP, registry=r)
        self.prompt_tokens = Counter("zerod_engine_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("zerod_engine_generation_tokens", "Tokens generated.", registry=r)
        self.requests_total = Counter("zerod_engine_requests", "Finished requests by reason.",
                                      ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests_total.labels(finished_reason=reason)
        r.register(_EngineCollector(snapshot))
