"""The engine's Prometheus registry (names in docs/perf.md and docs/engine-server.md).

Gauges and the allocator / stream-error counters are collected at scrape time from the
engine (a custom collector reading its cached state); histograms and token / request
counters are observed by the output poller as tokens arrive.

The names below are the one list of the engine's series as a scrape shows them
(counters end in `_total`); the daemon's engine-metrics watcher imports them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REQUESTS_RUNNING = "zerod_engine_requests_running"
REQUESTS_WAITING = "zerod_engine_requests_waiting"
KV_PAGES_FREE = "zerod_engine_kv_pages_free"
KV_PAGES_TOTAL = "zerod_engine_kv_pages_total"
ALLOCATOR_RETRIES_TOTAL = "zerod_engine_allocator_retries_total"
ALLOCATOR_OOMS_TOTAL = "zerod_engine_allocator_ooms_total"
STREAM_ERRORS_TOTAL = "zerod_engine_stream_errors_total"
PROMPT_TOKENS_TOTAL = "zerod_engine_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "zerod_engine_generation_tokens_total"
REQUESTS_TOTAL = "zerod_engine_requests_total"
TIME_TO_FIRST_TOKEN_SECONDS = "zerod_engine_time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "zerod_engine_inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "zerod_engine_e2e_request_latency_seconds"
STEP_SECONDS = "zerod_engine_step_seconds"
PREFIX_CACHE_QUERIES_TOTAL = "zerod_engine_prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "zerod_engine_prefix_cache_hits_total"
PREFIX_CACHE_PAGES = "zerod_engine_prefix_cache_pages"

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
        0.75, 1.0, 2.5, 5.0, 10.0)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_STEP = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


def _family(total_name: str) -> str:
    """prometheus_client adds `_total` to a counter's family name."""
    return total_name.removesuffix("_total")


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot()
        for name, key, doc in ((REQUESTS_RUNNING, "requests_running", "Requests being decoded or prefilled."),
                               (REQUESTS_WAITING, "requests_waiting", "Requests in the wait line."),
                               (KV_PAGES_FREE, "kv_pages_free", "KV pages free now.")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        # The documented name ends in _total, which promtool accepts only on counters; the pool's
        # size never changes while the engine lives, so a (constant) counter it is.
        yield CounterMetricFamily(_family(KV_PAGES_TOTAL), "KV pages a request can get (the pool's size).",
                                  value=s["kv_pages_total"])
        yield CounterMetricFamily(_family(ALLOCATOR_RETRIES_TOTAL),
                                  "torch CUDA caching allocator retries (num_alloc_retries); 0 on CPU.",
                                  value=s["allocator_retries"])
        yield CounterMetricFamily(_family(ALLOCATOR_OOMS_TOTAL),
                                  "torch CUDA caching allocator out-of-memory errors (num_ooms); 0 on CPU.",
                                  value=s["allocator_ooms"])
        yield CounterMetricFamily(_family(STREAM_ERRORS_TOTAL),
                                  "CUDA errors surfaced by an event or stream query (other than not-ready).",
                                  value=s["stream_errors"])
        yield CounterMetricFamily(_family(PREFIX_CACHE_QUERIES_TOTAL),
                                  "Prompt tokens looked up in the prefix cache.", value=s["prefix_cache_queries"])
        yield CounterMetricFamily(_family(PREFIX_CACHE_HITS_TOTAL),
                                  "Prompt tokens whose KV the prefix cache had.", value=s["prefix_cache_hits"])
        yield GaugeMetricFamily(PREFIX_CACHE_PAGES, "KV pages holding cached prefixes (counted as free "
                                "when no request uses them).", value=s["prefix_cache_pages"])


class EngineMetrics:
    def __init__(self, snapshot: Callable[[], dict]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(TIME_TO_FIRST_TOKEN_SECONDS,
                              "Time from submit to the first token.", buckets=_LAT + (20.0, 60.0), registry=r)
        self.itl = Histogram(INTER_TOKEN_LATENCY_SECONDS,
                             "Time between consecutive tokens of a request.", buckets=_LAT, registry=r)
        self.e2e = Histogram(E2E_REQUEST_LATENCY_SECONDS,
                             "Time from submit to the end of a request.", buckets=_E2E, registry=r)
        self.step_seconds = Histogram(STEP_SECONDS,
                                      "Device time of one engine step (prefill chunks + one decode).",
                                      buckets=_STEP, registry=r)
        self.prompt_tokens = Counter(_family(PROMPT_TOKENS_TOTAL), "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(_family(GENERATION_TOKENS_TOTAL), "Tokens generated.", registry=r)
        self.requests_total = Counter(_family(REQUESTS_TOTAL), "Finished requests by reason.",
                                      ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests_total.labels(finished_reason=reason)
        r.register(_EngineCollector(snapshot))
