"""zerod bench for vLLM users: the chat backend, a ShareGPT file, bursty arrivals, vLLM's
result file, and the throughput-table scenario, against a live (fake-engine) server."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from click.testing import CliRunner
from zerod.bench.arrivals import next_gap
from zerod.bench.cli import bench
from zerod.engine.api.server import ServerThread

VLLM_KEYS = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors",
             *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
               for m in ("ttft", "tpot", "itl", "e2el"))}


@pytest.fixture(scope="module")
def fake_server():
    from test_server_fake import FakeEngine

    eng = FakeEngine(tick=0.002)
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


def _sharegpt(path, replies=(40, 80, 120)):
    """Conversations whose replies are n characters long (n / 4 tokens), and entries
    a reader must skip."""
    data = [{"id": i, "conversations": [
        {"from": "human", "value": f"question number {i} " * 2},
        {"from": "gpt", "value": "x" * n}]} for i, n in enumerate(replies)]
    data += [{"conversations": [{"from": "human", "value": "hi there, how are you"}]},
             {"nothing": 1}, "junk",
             {"conversations": [{"from": "human", "value": "ab"}, {"from": "gpt", "value": "x" * 40}]}]
    path.write_text(json.dumps(data))
    return {n // 4 for n in replies}


def test_sharegpt_over_the_chat_endpoint_saved_as_vllm_result(fake_server, tmp_path):
    eng, srv = fake_server
    lens = _sharegpt(tmp_path / "sg.json")
    before = len(eng.submitted)
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--backend", "openai-chat", "--dataset-name", "sharegpt",
        "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "9",
        "--max-concurrency", "3", "--warmup", "0", "--save-result", "--result-dir",
        str(tmp_path / "res"), "--result-filename", "run.json", "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "res" / "run.json").read_text())
    assert VLLM_KEYS <= set(doc)
    assert (doc["backend"], doc["completed"], doc["num_prompts"]) == ("openai-chat", 9, 9)
    assert doc["max_concurrency"] == 3 and doc["request_rate"] == "inf"
    assert set(doc["output_lens"]) == lens  # each reply's length, from the file
    assert doc["total_output_tokens"] == sum(doc["output_lens"])
    assert len(doc["ttfts"]) == 9 and all(t > 0 for t in doc["ttfts"])
    assert doc["median_ttft_ms"] == pytest.approx(statistics.median(doc["ttfts"]) * 1000)
    assert doc["mean_e2el_ms"] >= doc["mean_ttft_ms"] > 0
    assert doc["zerod"]["max_itl_ms"] >= doc["p99_itl_ms"]
    # the requests were chat requests with the files' prompts
    sent = eng.submitted[before:]
    assert len(sent) == 9 and {p.max_tokens for _, _, p in sent} == lens


def test_random_prompts_over_chat_are_words(fake_server, tmp_path):
    eng, srv = fake_server
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--backend", "openai-chat", "--num-prompts", "3",
        "--input-len", "16", "--output-len", "5", "--warmup", "0", "--save-result",
        "--result-dir", str(tmp_path), "--no-progress"])
    assert r.exit_code == 0, r.output
    (saved,) = tmp_path.glob("openai-chat-infqps-concurrency16-fake-*.json")
    doc = json.loads(saved.read_text())
    assert doc["completed"] == 3 and set(doc["output_lens"]) == {5}
    # a word is at least 2 characters and the fake tokenizes per character
    assert min(doc["input_lens"]) > 16 * 2


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    rng = random.Random(1)
    rate = 50.0
    spread = {}
    for b in (0.25, 1.0, 4.0):
        gaps = [next_gap(rng, rate, b) for _ in range(40000)]
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
        spread[b] = statistics.pvariance(gaps) * rate * rate   # = 1 / burstiness
        assert spread[b] == pytest.approx(1 / b, rel=0.15)
    assert next_gap(rng, float("inf"), 0.5) == 0.0


def test_throughput_table_scenario_in_one_command(fake_server, tmp_path):
    eng, srv = fake_server
    out = tmp_path / "t.json"
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--scenario", "throughput-table", "--num-prompts", "6",
        "--max-concurrency", "6", "--input-len", "12", "--output-len", "7",
        "--out", str(out), "--save-result", "--result-dir", str(tmp_path / "res"),
        "--no-progress"])
    assert r.exit_code == 0, r.output
    phases = json.loads(out.read_text())["scenarios"]["throughput-table"]["phases"]
    assert list(phases) == ["burst-1", "burst-2", "closed-loop", "decode-b1", "prefill-16k"]
    for name in ("burst-1", "burst-2", "decode-b1"):
        assert phases[name]["completed"] == 6 and phases[name]["total_output_tokens"] == 42
    assert phases["burst-1"]["config"]["warmup"] == 0
    # the burst's 6 users, three requests each, one after another
    closed = phases["closed-loop"]
    assert closed["completed"] == 18 and closed["total_output_tokens"] == 18 * 7
    assert (closed["config"]["concurrency"], closed["config"]["warmup"]) == (6, 0)
    assert phases["prefill-16k"]["total_output_tokens"] == 6  # max_tokens 1, its definition
    assert phases["decode-b1"]["config"]["concurrency"] == 6  # the flag overrides the shape
    assert "_raw" not in json.dumps(json.loads(out.read_text()))
    saved = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert len(saved) == 5 and all("throughput-table" in n for n in saved)
    assert "throughput-table:burst-2" in r.output


@pytest.mark.parametrize("args,needle", [
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/no/such.json"], "cannot read"),
    (["--burstiness", "0"], "--burstiness"),
    (["--backend", "tgi"], "--backend"),
])
def test_bench_vllm_flag_errors_are_usage_errors(args, needle):
    r = CliRunner().invoke(bench, ["--base-url", "http://127.0.0.1:9", *args, "--no-progress"])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


def test_sharegpt_file_without_usable_entries(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    r = CliRunner().invoke(bench, ["--base-url", "http://127.0.0.1:9", "--dataset-name",
                                   "sharegpt", "--dataset-path", str(p)])
    assert r.exit_code == 2 and "no conversation" in r.output
