"""The engine's Prometheus registry (names in docs/engine-server.md).

Gauges and the allocator / stream-error counters are collected at scrape time from the
engine (a custom collector reading its cached state); histograms and token / request
counters are observed by the output poller as tokens arrive.

The names below are the one list of the engine's series as a scrape shows them
(counters end in `_total`); the daemon's engine-metrics watcher imports them.

Beside them, the series vLLM's dashboards, autoscalers and gateways read are published
under vLLM's names (`vllm:*`, each with a `model_name` label) from the same observations:
one `_Twin` observes both (the inter-token gaps: one `StepHistogram` holds them), so the
two families cannot disagree. promtool's lint flags the
`:` in those names (a convention for recording rules); that is the only finding.
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable

import platform

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# No `_created` series beside each counter and histogram: Prometheus reads them as
# separate series nobody charts (this is prometheus_client's process-wide switch; the
# daemon's registry imports this module and shares it).
prometheus_client.disable_created_metrics()

REQUESTS_RUNNING = "zerod_engine_requests_running"
REQUESTS_WAITING = "zerod_engine_requests_waiting"
KV_PAGES_FREE = "zerod_engine_kv_pages_free"
KV_POOL_PAGES = "zerod_engine_kv_pool_pages"     # the pool's size: a capacity, so a gauge
# the same value under its first name, a counter because of the `_total`; deprecated, kept
# for the dashboards and rules written against it
KV_PAGES_TOTAL = "zerod_engine_kv_pages_total"
BUILD_INFO = "zerod_build_info"
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
LORA_REQUESTS_TOTAL = "zerod_engine_lora_requests_total"   # by lora_name: requests accepted per adapter
# steps whose launch took the step thread over SLOW_STEP_S, by reason (SLOW_STEP_REASONS)
SLOW_STEPS_TOTAL = "zerod_engine_slow_steps_total"
# the longest gap between two tokens of any stream over the last MAX_ITL_WINDOW_S
MAX_ITL_SECONDS = "zerod_engine_max_inter_token_latency_seconds"
SLOW_STEP_S = 0.010
SLOW_STEP_REASONS = ("kernel_build", "garbage_collection", "device_queue", "waiting", "host")
MAX_ITL_WINDOW_S = 60

# A request with this header set to "1" (the daemon's canary) is served like any other and
# kept out of every series here: the latency baseline and the users' figures never see it.
CANARY_HEADER = "X-Zerod-Canary"

# vLLM's names for the same facts (vllm/v1/metrics/loggers.py), labelled by model_name.
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
VLLM_TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
VLLM_INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
VLLM_PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
VLLM_REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
# a finished request's phases, as vLLM splits them: queued -> scheduled (admitted) ->
# first token (prefill) -> last token (decode); inference = prefill + decode
VLLM_REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
VLLM_REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
VLLM_REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
VLLM_REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
VLLM_ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"   # a histogram, vLLM's name
VLLM_PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
VLLM_NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
# with --enable-lora: the adapters running and waiting (comma-separated label values) and
# --max-loras, the value the time of the last update, as vLLM; LoRA-aware gateways route on it
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# vLLM counts a request as a success when it ends by stop, length or abort (not error).
VLLM_SUCCESS_REASONS = ("stop", "length", "abort")

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
        0.75, 1.0, 2.5, 5.0, 10.0)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_PHASE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)   # vLLM's request-time buckets
_ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


def _family(total_name: str) -> str:
    """prometheus_client adds `_total` to a counter's family name."""
    return total_name.removesuffix("_total")


class _Twin:
    """One observation, two series: zerod's and vLLM's (labelled child)."""

    __slots__ = ("a", "b", "inc", "observe")

    def __init__(self, a, b):
        self.a, self.b = a, b
        if hasattr(a, "observe"):
            self.observe = lambda v: (a.observe(v), b.observe(v))
        else:
            self.inc = lambda v=1: (a.inc(v), b.inc(v))


class StepHistogram:
    """A histogram the output poller feeds a step's values at once, exposed under zerod's
    name and vLLM's (labelled with the model): the inter-token gaps, one a streaming row a
    step. prometheus_client observes one value at a time, two locked increments each and
    twice for the twin; here a step's gaps take one lock and a bisect each
    (`gpu/poller_cost.py` measures the poller's time a token)."""

    def __init__(self, name: str, vllm_name: str, doc: str, buckets: tuple[float, ...], model_name: str):
        self.names = (name, vllm_name)
        self.doc, self.model_name = doc, model_name
        self.bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)   # per bucket, the last one +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values) -> None:
        counts, bounds, at = self._counts, self.bounds, bisect.bisect_left
        with self._lock:
            total = self._sum
            for v in values:
                counts[at(bounds, v)] += 1       # the first bucket whose bound is >= v
                total += v                       # in order, as one observation at a time adds
            self._sum = total

    def describe(self):
        return [HistogramMetricFamily(self.names[0], self.doc),
                HistogramMetricFamily(self.names[1], self.doc, labels=["model_name"])]

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cum, buckets = 0, []
        for bound, c in zip(self.bounds + (float("inf"),), counts):
            cum += c
            buckets.append((floatToGoString(bound), cum))
        ours = HistogramMetricFamily(self.names[0], self.doc)
        ours.add_metric([], buckets, total)
        vllm = HistogramMetricFamily(self.names[1], self.doc, labels=["model_name"])
        vllm.add_metric([self.model_name], buckets, total)
        return [ours, vllm]


class RollingMax:
    """The largest value observed over the last `window` seconds, kept as one maximum per
    second (a fixed ring: no allocation per observation)."""

    def __init__(self, window: int = MAX_ITL_WINDOW_S, clock: Callable[[], float] | None = None):
        import time
        self.window = window
        self.clock = clock or time.monotonic
        self._sec = [-1] * window
        self._max = [0.0] * window

    def observe(self, value: float) -> None:
        s = int(self.clock())
        i = s % self.window
        if self._sec[i] != s:
            self._sec[i], self._max[i] = s, value
        elif value > self._max[i]:
            self._max[i] = value

    def value(self) -> float:
        now = int(self.clock())
        return max((m for s, m in zip(self._sec, self._max) if now - s < self.window), default=0.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict], model_name: str, max_itl: RollingMax):
        self.snapshot = snapshot
        self.model_name = model_name
        self.max_itl = max_itl

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot()
        for name, key, doc in ((REQUESTS_RUNNING, "requests_running", "Requests being decoded or prefilled."),
                               (REQUESTS_WAITING, "requests_waiting", "Requests in the wait line."),
                               (KV_PAGES_FREE, "kv_pages_free", "KV pages free now.")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily(KV_POOL_PAGES, "KV pages a request can get (the pool's size).",
                                value=s["kv_pages_total"])
        yield CounterMetricFamily(_family(KV_PAGES_TOTAL), f"Deprecated: {KV_POOL_PAGES}, the same "
                                  "value (a capacity, exported as a counter under this name).",
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
        yield GaugeMetricFamily(MAX_ITL_SECONDS, f"The longest gap between two tokens of any stream "
                                f"over the last {MAX_ITL_WINDOW_S} s.", value=self.max_itl.value())
        total = s["kv_pages_total"]
        for name, value, doc in (
                (VLLM_NUM_REQUESTS_RUNNING, s["requests_running"], "Number of requests in model execution batches."),
                (VLLM_NUM_REQUESTS_WAITING, s["requests_waiting"], "Number of requests waiting to be processed."),
                (VLLM_KV_CACHE_USAGE_PERC, (total - s["kv_pages_free"]) / total if total else 0.0,
                 "KV-cache usage. 1 means 100 percent usage.")):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        for name, value, doc in (
                (VLLM_PREFIX_CACHE_QUERIES_TOTAL, s["prefix_cache_queries"],
                 "Prefix cache queries, in prompt tokens queried."),
                (VLLM_PREFIX_CACHE_HITS_TOTAL, s["prefix_cache_hits"],
                 "Prefix cache hits, in prompt tokens the cache had."),
                (VLLM_NUM_PREEMPTIONS_TOTAL, 0, "Cumulative number of preemptions. Always 0 "
                 "here: zerod never preempts (a request's KV pages are reserved at admission).")):
            c = CounterMetricFamily(_family(name), doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        if s.get("lora_info") is not None:
            running, waiting, max_loras, at = s["lora_info"]
            g = GaugeMetricFamily(VLLM_LORA_REQUESTS_INFO, "Running stats on LoRA requests.",
                                  labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            g.add_metric([running, str(max_loras), waiting], at)
            yield g


class EngineMetrics:
    def __init__(self, snapshot: Callable[[], dict], model_name: str = "model"):
        r = self.registry = CollectorRegistry(auto_describe=True)
        mn = ["model_name"]

        def hist(name, vname, doc, buckets):
            return _Twin(Histogram(name, doc, buckets=buckets, registry=r),
                         Histogram(vname, doc, mn, buckets=buckets, registry=r).labels(model_name))

        def counter(name, vname, doc):
            return _Twin(Counter(_family(name), doc, registry=r),
                         Counter(_family(vname), doc, mn, registry=r).labels(model_name))

        self.ttft = hist(TIME_TO_FIRST_TOKEN_SECONDS, VLLM_TIME_TO_FIRST_TOKEN_SECONDS,
                         "Time from submit to the first token.", _LAT + (20.0, 60.0))
        self.itl = StepHistogram(INTER_TOKEN_LATENCY_SECONDS, VLLM_INTER_TOKEN_LATENCY_SECONDS,
                                 "Time between consecutive tokens of a request.", _LAT, model_name)
        r.register(self.itl)
        self.e2e = hist(E2E_REQUEST_LATENCY_SECONDS, VLLM_E2E_REQUEST_LATENCY_SECONDS,
                        "Time from submit to the end of a request.", _E2E)
        phase = {name: Histogram(name, doc, mn, buckets=_PHASE, registry=r).labels(model_name)
                 for name, doc in (
                     (VLLM_REQUEST_QUEUE_TIME_SECONDS, "Time a request spent in the wait line."),
                     (VLLM_REQUEST_PREFILL_TIME_SECONDS, "Time from admission to a request's "
                      "first token."),
                     (VLLM_REQUEST_DECODE_TIME_SECONDS, "Time from a request's first token to "
                      "its last."),
                     (VLLM_REQUEST_INFERENCE_TIME_SECONDS, "Time from admission to a request's "
                      "last token."))}
        self.queue_time = phase[VLLM_REQUEST_QUEUE_TIME_SECONDS]
        self.prefill_time = phase[VLLM_REQUEST_PREFILL_TIME_SECONDS]
        self.decode_time = phase[VLLM_REQUEST_DECODE_TIME_SECONDS]
        self.inference_time = phase[VLLM_REQUEST_INFERENCE_TIME_SECONDS]
        self.iteration_tokens = Histogram(VLLM_ITERATION_TOKENS_TOTAL, "Tokens per "
                                          "engine step (prompt tokens + decodes).", mn,
                                          buckets=_ITERATION_TOKENS, registry=r).labels(model_name)
        build_info(r, "engine")
        self.step_seconds = Histogram(STEP_SECONDS,
                                      "Device time of one engine step (prefill chunks + one decode).",
                                      buckets=_STEP, registry=r)
        self.prompt_tokens = counter(PROMPT_TOKENS_TOTAL, VLLM_PROMPT_TOKENS_TOTAL, "Prompt tokens processed.")
        self.generation_tokens = counter(GENERATION_TOKENS_TOTAL, VLLM_GENERATION_TOKENS_TOTAL, "Tokens generated.")
        self.requests_total = Counter(_family(REQUESTS_TOTAL), "Finished requests by reason.",
                                      ["finished_reason"], registry=r)
        self.request_success = Counter(_family(VLLM_REQUEST_SUCCESS_TOTAL), "Count of successfully processed "
                                       "requests.", ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests_total.labels(finished_reason=reason)
        for reason in VLLM_SUCCESS_REASONS:
            self.request_success.labels(model_name, reason)
        self.lora_requests = Counter(_family(LORA_REQUESTS_TOTAL), "Requests accepted for each LoRA "
                                     "adapter.", ["lora_name"], registry=r)
        self.slow_steps = Counter(_family(SLOW_STEPS_TOTAL), f"Steps whose launch held the step thread over "
                                  f"{SLOW_STEP_S * 1000:.0f} ms, by what held it: a kernel built on first use, "
                                  f"garbage collection, the device's queue full of earlier steps, waiting for "
                                  f"the GIL or a core, or the step's own host work.", ["reason"], registry=r)
        for reason in SLOW_STEP_REASONS:
            self.slow_steps.labels(reason=reason)
        self.max_itl = RollingMax()
        self.model_name = model_name
        r.register(_EngineCollector(snapshot, model_name, self.max_itl))

    def phases(self, arrival: float, scheduled: float | None, first: float | None,
               last: float | None) -> None:
        """A finished request's phases (vLLM's per-phase histograms); a request that never
        got a first token has only its queue time."""
        if scheduled is None:
            return
        self.queue_time.observe(scheduled - arrival)
        if first is None or last is None:
            return
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)

    def lora_request(self, name: str) -> None:
        """Count a request accepted for LoRA adapter `name`."""
        self.lora_requests.labels(lora_name=name).inc()

    def finished(self, reason: str) -> None:
        """Count a request that ended with `reason` (stop | length | abort | error)."""
        self.requests_total.labels(finished_reason=reason).inc()
        if reason in VLLM_SUCCESS_REASONS:
            self.request_success.labels(self.model_name, reason).inc()


def build_info(registry: CollectorRegistry, component: str) -> None:
    """zerod_build_info{version, python, component} 1: which build answers this scrape."""
    from zerod import __version__

    g = Gauge(BUILD_INFO, "The zerod build serving these metrics (always 1).",
              ["version", "python", "component"], registry=registry)
    g.labels(__version__, platform.python_version(), component).set(1)
