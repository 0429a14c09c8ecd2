"""/metrics as vLLM's dashboards read it: the per-phase request histograms, tokens per
step, the prefix cache and preemptions under vLLM's names beside zerod's own; the KV
pool's size as a gauge (its old counter name kept, marked deprecated); no `_created`
series; zerod_build_info."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zerod.engine import metrics as names
from zerod.engine.api.server import ServerThread


@pytest.fixture(scope="module")
def scrape():
    import openai
    from zerod.engine.core.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="demo", device="cpu", max_model_len=256, kv_pages=128,
                              max_num_seqs=8, seed=0))
    eng.start()
    srv = ServerThread(eng).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            c.completions.create(model=eng.model_name, prompt="the same prompt " * 4,
                                 max_tokens=6, extra_body={"ignore_eos": True})
        # the poller counts a step's gaps after it hands the step's tokens on, so the
        # last answer can reach the client first: scrape once it has handled every step
        deadline = time.monotonic() + 10
        while eng.poller.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
        yield eng, text, {f.name: f for f in text_string_to_metric_families(text)}
    finally:
        srv.stop()
        eng.shutdown(0)


def _value(fams, family, sample, **labels):
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"{sample} {labels} not scraped")


@pytest.mark.parametrize("name", [names.VLLM_REQUEST_QUEUE_TIME_SECONDS,
                                  names.VLLM_REQUEST_PREFILL_TIME_SECONDS,
                                  names.VLLM_REQUEST_DECODE_TIME_SECONDS,
                                  names.VLLM_REQUEST_INFERENCE_TIME_SECONDS])
def test_vllm_phase_histograms_count_each_finished_request(scrape, name):
    eng, _, fams = scrape
    assert fams[name].type == "histogram"
    assert _value(fams, name, name + "_count", model_name=eng.model_name) == 3
    assert _value(fams, name, name + "_sum", model_name=eng.model_name) >= 0


def test_phases_add_up(scrape):
    eng, _, fams = scrape
    s = {n: _value(fams, n, n + "_sum", model_name=eng.model_name) for n in (
        names.VLLM_REQUEST_PREFILL_TIME_SECONDS, names.VLLM_REQUEST_DECODE_TIME_SECONDS,
        names.VLLM_REQUEST_INFERENCE_TIME_SECONDS)}
    assert s[names.VLLM_REQUEST_INFERENCE_TIME_SECONDS] == pytest.approx(
        s[names.VLLM_REQUEST_PREFILL_TIME_SECONDS] + s[names.VLLM_REQUEST_DECODE_TIME_SECONDS])


def test_iteration_tokens_prefix_cache_and_preemptions(scrape):
    eng, _, fams = scrape
    fam = names.VLLM_ITERATION_TOKENS_TOTAL  # a histogram: vLLM keeps the _total
    steps = _value(fams, fam, names.VLLM_ITERATION_TOKENS_TOTAL + "_count",
                   model_name=eng.model_name)
    tokens = _value(fams, fam, names.VLLM_ITERATION_TOKENS_TOTAL + "_sum",
                    model_name=eng.model_name)
    assert steps >= 6 and tokens >= 3 * 6  # every output token was decoded in some step
    q = names.VLLM_PREFIX_CACHE_QUERIES_TOTAL
    h = names.VLLM_PREFIX_CACHE_HITS_TOTAL
    assert _value(fams, q.removesuffix("_total"), q, model_name=eng.model_name) == \
        _value(fams, "zerod_engine_prefix_cache_queries", names.PREFIX_CACHE_QUERIES_TOTAL)
    # the same prompt three times: the later ones hit
    assert _value(fams, h.removesuffix("_total"), h, model_name=eng.model_name) > 0
    p = names.VLLM_NUM_PREEMPTIONS_TOTAL
    assert _value(fams, p.removesuffix("_total"), p, model_name=eng.model_name) == 0
    assert "never preempts" in fams[p.removesuffix("_total")].documentation


def test_kv_pool_is_a_gauge_and_the_old_name_stays(scrape):
    eng, _, fams = scrape
    assert fams[names.KV_POOL_PAGES].type == "gauge"
    pool = _value(fams, names.KV_POOL_PAGES, names.KV_POOL_PAGES)
    assert pool == eng.stats().kv_pages_total
    old = names.KV_PAGES_TOTAL.removesuffix("_total")
    assert _value(fams, old, names.KV_PAGES_TOTAL) == pool
    assert fams[old].documentation.startswith("Deprecated")


def test_no_created_series_and_build_info(scrape):
    _, text, fams = scrape
    assert "_created" not in text
    from zerod import __version__

    assert _value(fams, names.BUILD_INFO, names.BUILD_INFO, version=__version__,
                  component="engine") == 1


def test_daemon_reads_the_pool_under_either_name():
    from zerod.watchers.engine_metrics import parse_metrics

    new, _, _ = parse_metrics(f"{names.KV_POOL_PAGES} 40\n")
    old, _, _ = parse_metrics(f"{names.KV_PAGES_TOTAL} 41\n")
    assert new[names.KV_PAGES_TOTAL] == 40 and old[names.KV_PAGES_TOTAL] == 41


def test_inter_token_gaps_under_both_names(scrape):
    """3 requests of 6 tokens: 5 gaps each, counted once under zerod's name and once under
    vLLM's (labelled with the model), the same buckets, sums and counts in both."""
    eng, _, fams = scrape
    ours = {(s.name, s.labels.get("le")): s.value for s in fams[names.INTER_TOKEN_LATENCY_SECONDS].samples}
    vllm = {(s.name, s.labels.get("le")): s.value for s in fams[names.VLLM_INTER_TOKEN_LATENCY_SECONDS].samples
            if s.labels.get("model_name") == eng.model_name}
    assert ours[(names.INTER_TOKEN_LATENCY_SECONDS + "_count", None)] == 15
    assert ours[(names.INTER_TOKEN_LATENCY_SECONDS + "_bucket", "+Inf")] == 15
    assert [v for (n, le), v in sorted(ours.items()) if n.endswith("_bucket")] == \
        [v for (n, le), v in sorted(vllm.items()) if n.endswith("_bucket")]
    assert vllm[(names.VLLM_INTER_TOKEN_LATENCY_SECONDS + "_sum", None)] == ours[(names.INTER_TOKEN_LATENCY_SECONDS + "_sum", None)] > 0


def test_a_steps_gaps_expose_as_prometheus_clients_histogram():
    """The batched histogram's exposition equals prometheus_client's Histogram fed the same
    values one at a time, boundaries included (a value equal to a bound is in its bucket)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    values = [0.0005, 0.001, 0.0025, 0.004, 0.05, 0.05, 0.31, 7.0, 120.0]
    batched, plain = CollectorRegistry(), CollectorRegistry()
    h = names.StepHistogram("gap_seconds", "vllm:gap_seconds", "Gaps.", names._LAT, "m")
    batched.register(h)
    h.observe_many(values[:4])
    h.observe_many(values[4:])
    ref = Histogram("gap_seconds", "Gaps.", buckets=names._LAT, registry=plain)
    ref_vllm = Histogram("vllm:gap_seconds", "Gaps.", ["model_name"], buckets=names._LAT, registry=plain).labels("m")
    for v in values:
        ref.observe(v)
        ref_vllm.observe(v)
    assert generate_latest(batched) == generate_latest(plain)
