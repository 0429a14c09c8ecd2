"""Other engines as first-class: `[daemon] engine = "vllm" | "sglang"` presets —
their command lines, health and metric names — and a whole daemon supervising
a vLLM-shaped server (tests/fake_vllm.py: /health without a pid, vllm:*
series with vLLM's labels and real histogram buckets)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from test_daemon_lifecycle import free_port  # same folder
from zerod.cmd_config import check_config
from zerod.daemon import Daemon
from zerod.daemon_config import DaemonConfig
from zerod.supervisor import engine_argv, engine_env, engine_url
from zerod.watchers.engine_metrics import parse_metrics
from zerod.engines import PRESETS

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


def test_vllm_and_sglang_command_lines_from_the_engine_table():
    engine = {"model": "/srv/llama", "max_num_seqs": 64, "enable_prefix_caching": True, "enforce_eager": False,
              "gpu_memory_utilization": 0.9, "port": 8001, "api_key": "k"}
    assert engine_argv(engine, kind="vllm") == [
        "vllm", "serve", "/srv/llama", "--max-num-seqs", "64", "--enable-prefix-caching",
        "--gpu-memory-utilization", "0.9", "--port", "8001"]
    assert engine_argv(engine, kind="sglang") == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/srv/llama", "--max-running-requests", "64",
        "--enable-prefix-caching", "--mem-fraction-static", "0.9", "--port", "8001", "--enable-metrics"]
    assert engine_env(engine, kind="vllm") == {"VLLM_API_KEY": "k"}  # the key never on the command line
    assert engine_env({"api_key": "k"}, kind="zerod") == {"ZEROD_API_KEY": "k"}
    assert engine_url({}, DaemonConfig.from_dict({"engine": "sglang"})) == "http://127.0.0.1:30000"
    assert engine_url({}, DaemonConfig.from_dict({"engine": "vllm"})) == "http://127.0.0.1:8000"


def test_config_check_takes_the_engine_s_own_flags():
    assert check_config({"daemon": {"engine": "vllm"},
                         "engine": {"model": "/srv/m", "tensor_parallel_size": 2, "enable_chunked_prefill": True}}) == []
    assert check_config({"daemon": {"engine": "vllm"}, "engine": {"model": "/srv/m", "x": {"a": 1}}}) == [
        "[engine] x = { a = 1 }: must be a value, a list of values or true/false"]
    [r] = check_config({"daemon": {"engine": "sglang"}, "engine": {"model": "/srv/m", "api_key": "k"}})
    assert "sglang takes its key only on the command line" in r and '"k"' not in r
    [r] = check_config({"daemon": {"engine": "tgi"}, "engine": {"model": "x"}})
    assert r == '[daemon] engine = "tgi": must be one of zerod, vllm, sglang'


def test_vllm_and_sglang_series_read_under_the_daemon_s_names():
    vllm = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="m"} 12.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',  # data-parallel ranks: summed
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 90.0',
        'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0',
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0',
        'vllm:inter_token_latency_seconds_bucket{engine="1",le="0.01",model_name="m"} 10.0',
        'vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf",model_name="m"} 100.0',
        'vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 100.0',
        # the older name, still served by some versions beside the new one: not counted twice
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0',
        'vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 7.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 5000.0', ""])
    values, ttft, itl = parse_metrics(vllm, PRESETS["vllm"].series)
    assert values["zerod_engine_requests_running"] == 16 and values["zerod_engine_requests_waiting"] == 2
    assert values["zerod_engine_generation_tokens_total"] == 5000
    assert itl.count == 200 and itl.buckets == {0.01: 100.0, float("inf"): 200.0} and ttft.count == 0
    old = 'sglang:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 3\n' \
          'sglang:time_per_output_token_seconds_count{model_name="m"} 3\nsglang:num_running_reqs{model_name="m"} 5\n'
    values, _, itl = parse_metrics(old, PRESETS["sglang"].series)
    assert itl.count == 3 and values["zerod_engine_requests_running"] == 5


async def test_a_daemon_supervises_a_vllm_shaped_server_and_sees_its_latency_regress(tmp_path):
    port = free_port()
    config = {"engine": {"port": port}, "doctor": {}, "alerts": {},
              "daemon": {"engine": "vllm", "engine_command": [sys.executable, str(FAKE_VLLM), str(port)],
                         "preflight": False, "numa": "off", "metrics_port": -1,
                         "control_socket": str(tmp_path / "control.sock"), "watch_interval_s": 0.2,
                         "latency_window_s": 2.0, "latency_baseline_min_samples": 500,
                         "latency_baseline_min_s": 1.0}}
    d = Daemon(config)
    run = asyncio.create_task(d.run())

    async def until(what, seconds, why):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if d.views is not None and what():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {why} within {seconds} s")

    try:
        await until(lambda: d.ready_at is not None, 15, "READY (the engine's /health, no pid in it)")
        status = d.views.status()["engine"]
        assert status["state"] == "healthy" and status["kind"] == "vllm"
        await until(lambda: d.views.engine()["itl_normal_p99_s"] is not None, 15, "a learned normal")
        doc = d.views.engine()
        assert doc["running"] == 32 and doc["waiting"] == 1 and doc["load_bucket"] == "32-47"
        assert 0.005 < doc["itl_p99_s"] <= 0.01 and doc["output_tokens_per_s"] > 500
        assert not [a for a in d.book.firing() if a.alertname == "LatencyRegression"]
        os.kill(d.supervisors[0].pid, signal.SIGUSR1)  # three times slower
        await until(lambda: d.book.get("LatencyRegression", "itl") is not None, 10, "LatencyRegression")
        a = d.book.get("LatencyRegression", "itl")
        assert "its normal" in a.summary and "32-47 concurrent requests" in a.summary
        d._on_signal(signal.SIGTERM)
        assert await asyncio.wait_for(run, 15) == 0
    finally:
        if not run.done():
            d._on_signal(signal.SIGTERM)
            d._on_signal(signal.SIGTERM)
            await asyncio.gather(run, return_exceptions=True)
