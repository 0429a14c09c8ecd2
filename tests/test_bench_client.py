"""zerod bench: statistics, /proc CPU reading, and a run against a live (fake-engine) server.

The run against the real tiny engine lives in tests/test_openai_server.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from zerod.bench.cli import bench
from zerod.bench.server_cpu import CpuWindow
from zerod.bench.stats import percentile, summary_ms
from zerod.engine.api.server import ServerThread


def test_percentile_matches_numpy_linear():
    v = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(v, 50) == 3.0
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 10.0
    assert percentile(v, 95) == pytest.approx(8.8)  # numpy.percentile(v, 95)
    assert percentile(v, 99) == pytest.approx(9.76)
    assert percentile([5.0], 99) == 5.0
    s = summary_ms([0.001, 0.003])
    assert s["n"] == 2 and s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)
    assert summary_ms([])["p50"] is None


def test_cpu_window_reads_own_process():
    w = CpuWindow(os.getpid())
    w.start()
    x = 0
    for i in range(2_000_000):
        x += i
    info = w.stop()
    assert info["cpu_s"] > 0 and 0 < info["cores"] <= os.cpu_count() + 0.5
    assert info["threads_cores"]
    assert CpuWindow(None).stop() is None


@pytest.fixture(scope="module")
def fake_server():
    from test_server_fake import FakeEngine

    eng = FakeEngine(tick=0.002)
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


def test_bench_random_and_named_scenarios(fake_server, tmp_path):
    eng, srv = fake_server
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--scenario", "streams-200", "--scenario", "long-context",
        "--scenario", "hello-ttft", "--num-prompts", "12", "--max-concurrency", "4",
        "--input-len", "20", "--short-input-len", "5", "--output-len", "9", "--warmup", "2",
        "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["model"] == "fake" and doc["server"]["status"] == "ok"
    s = doc["scenarios"]["streams-200"]
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == 12 * 9 and s["total_input_tokens"] == 12 * 20
    assert s["ttft_ms"]["n"] == 12 and s["itl_ms"]["n"] == 12 * 8
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] < 5000
    assert s["output_throughput"] > 0 and s["tpot_ms"]["p50"] > 0
    assert s["engine_cpu"]["pid"] == os.getpid() and s["engine_cpu"]["cores"] > 0
    lc = doc["scenarios"]["long-context"]
    assert lc["phases"]["short"]["total_input_tokens"] == 12 * 5
    assert lc["phases"]["long"]["total_input_tokens"] == 12 * 20
    assert lc["itl_p99_over_p50"]["long"] >= 1.0
    h = doc["scenarios"]["hello-ttft"]
    assert h["completed"] == 12 and h["total_output_tokens"] == 12
    assert h["total_input_tokens"] == 12 * 6  # the fake's tokenizer: BOS + 5 chars
    # the submitted requests carried ignore_eos and max_tokens = output len
    _, ids, params = eng.submitted[-30]
    assert params.ignore_eos and params.max_tokens == 9 and len(ids) in (5, 20)
    assert "TTFT" in r.output and "streams-200" in r.output


def test_bench_unreachable_server_is_a_plain_error():
    r = CliRunner().invoke(bench, ["--base-url", "http://127.0.0.1:9", "--no-progress"])
    assert r.exit_code != 0 and "cannot reach" in r.output
    assert "Traceback" not in r.output


def test_bench_worker_processes(fake_server, tmp_path):
    eng, srv = fake_server
    out = tmp_path / "w.json"
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--num-prompts", "10", "--max-concurrency", "5",
        "--input-len", "8", "--output-len", "6", "--warmup", "1", "--workers", "2",
        "--request-rate", "200", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["scenarios"]["random"]
    assert s["config"]["workers"] == 2
    assert (s["completed"], s["failed"]) == (10, 0)
    assert s["total_output_tokens"] == 60 and s["itl_ms"]["n"] == 50


def test_bench_interrupted_ends_without_a_traceback(fake_server):
    """Ctrl-C (or `timeout -s INT`) signals the whole process group, the worker processes
    too: the run ends with one line, no worker's traceback."""
    import signal
    import time

    eng, srv = fake_server
    sent = len(eng.submitted)
    p = subprocess.Popen([sys.executable, "-m", "zerod", "bench", "--base-url", srv.url,
                          "--request-rate", "20", "--num-prompts", "400",
                          "--workers", "2", "--input-len", "8", "--output-len", "6",
                          "--warmup", "0", "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True,
                         # a shell's background job inherits SIGINT ignored (a CI runner's
                         # may): the bench starts as a terminal would start it
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    # the workers are sending measured requests (their warm-up's ask for one token each)
    while (sum(params.max_tokens > 1 for _, _, params in eng.submitted[sent:]) < 4
           and time.monotonic() < deadline):
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0, (out, err)
    assert "Traceback" not in out + err and "Aborted" in out + err, (out, err)


def test_bench_imports_nothing_of_the_engine_nor_torch():
    code = ("import sys, zerod.bench.cli, zerod.bench.client\n"
            "print(sorted(m for m in sys.modules if m.startswith(('zerod.engine', 'torch'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_mix_and_prefix_payloads():
    from zerod.bench.client import Client, Load

    c = Client("http://x", "m", None, vocab_size=1000, seed=3, progress=False, server_pid=None)
    mix = Load(input_len_range=(32, 4096), output_len_range=(16, 512))
    ps = [c.payload(mix) for _ in range(400)]
    ins = sorted(len(p["prompt"]) for p in ps)
    outs = [p["max_tokens"] for p in ps]
    assert 32 <= ins[0] and ins[-1] <= 4096 and 16 <= min(outs) and max(outs) <= 512
    # log-uniform: the median sits near the geometric mean (362), far below the midpoint
    assert 200 < ins[200] < 650
    pre = Load(prefix_len=20, num_prefixes=3, suffix_len=5, output_len=4)
    ps = [c.payload(pre) for _ in range(60)]
    heads = {tuple(p["prompt"][:20]) for p in ps}
    assert len(heads) == 3 and all(len(p["prompt"]) == 25 for p in ps)
    assert len({tuple(p["prompt"][20:]) for p in ps}) == 60    # suffixes are unique


def test_bench_mix_prefix_and_goodput(fake_server, tmp_path):
    eng, srv = fake_server
    out = tmp_path / "m.json"
    r = CliRunner().invoke(bench, [
        "--base-url", srv.url, "--scenario", "mix", "--scenario", "prefix",
        "--num-prompts", "16", "--request-rate", "400", "--input-len-range", "4:64",
        "--output-len-range", "2:8", "--prefix-len", "12", "--num-prefixes", "2",
        "--suffix-len", "3", "--output-len", "4", "--goodput", "ttft:60000",
        "--goodput", "itl:60000", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())["scenarios"]
    m = doc["mix"]
    assert m["completed"] == 16 and m["config"]["input_len_range"] == [4, 64]
    assert 16 * 2 <= m["total_output_tokens"] <= 16 * 8
    assert m["goodput"]["good"] == 16 and m["goodput"]["share"] == 1.0
    p = doc["prefix"]
    assert p["completed"] == 16 and p["total_input_tokens"] == 16 * 15
    assert "goodput 16/16" in r.output
    # an SLO nobody meets
    r = CliRunner().invoke(bench, ["--base-url", srv.url, "--num-prompts", "4", "--input-len", "4",
                                   "--output-len", "3", "--goodput", "ttft:0.0001", "--out",
                                   str(out), "--no-progress"])
    assert json.loads(out.read_text())["scenarios"]["random"]["goodput"]["good"] == 0


@pytest.mark.parametrize("args", [["--input-len-range", "64:4"], ["--input-len-range", "x"],
                                  ["--goodput", "ttft"], ["--goodput", "speed:5"],
                                  ["--goodput", "ttft:-1"]])
def test_bench_bad_mix_flags_are_usage_errors(args):
    r = CliRunner().invoke(bench, ["--base-url", "http://127.0.0.1:9", "--no-progress", *args])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_bench_extra_body_reaches_every_request(fake_server, tmp_path):
    eng, srv = fake_server
    n0 = len(eng.submitted)
    r = CliRunner().invoke(bench, ["--base-url", srv.url, "--num-prompts", "3", "--input-len", "4",
                                   "--output-len", "3", "--warmup", "1", "--no-progress",
                                   "--extra-body", '{"seed": 7, "top_k": 3}'])
    assert r.exit_code == 0, r.output
    assert all(p.seed == 7 and p.top_k == 3 for _, _, p in eng.submitted[n0:])
    r = CliRunner().invoke(bench, ["--base-url", srv.url, "--extra-body", "[1]", "--no-progress"])
    assert r.exit_code == 2 and "JSON object" in r.output


def test_lora_modules_spread_requests_over_the_adapters():
    from zerod.bench.client import Client, Load

    c = Client("http://x", "base", None, vocab_size=1000, seed=1, progress=False, server_pid=None)
    c.lora_modules = ["a0", "a1", "a2"]
    names = [c.payload(Load(input_len=4, output_len=2))["model"] for _ in range(300)]
    assert set(names) == {"a0", "a1", "a2"}
    assert all(70 < names.count(n) < 130 for n in ("a0", "a1", "a2"))   # random, about even


def test_bench_lora_modules_flag(fake_server, tmp_path):
    eng, srv = fake_server
    out = tmp_path / "l.json"
    args = ["--base-url", srv.url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
            "--warmup", "0", "--no-progress", "--out", str(out)]
    # the fake engine serves the one model "fake": named through the flag, every request is served
    r = CliRunner().invoke(bench, args + ["--lora-modules", "fake"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["lora_modules"] == ["fake"]
    # a name it does not serve reaches the server as the model, which refuses every request
    r = CliRunner().invoke(bench, args + ["--lora-modules", "a0,a1"])
    assert r.exit_code == 1
    s = json.loads(out.read_text())["scenarios"]["random"]
    assert s["failed"] == 2 and any("does not exist" in e for e in s["errors"]), s["errors"]
    r = CliRunner().invoke(bench, ["--base-url", srv.url, "--no-progress", "--lora-modules", " , "])
    assert r.exit_code == 2 and "no adapter name" in r.output and "Traceback" not in r.output


def test_the_report_counts_stalls_and_the_longest_gap():
    """Every scenario says how long the longest gap between two tokens of a stream was
    and how many gaps passed 100 ms: a stall a user sees, whatever the percentiles say."""
    from zerod.bench.cli import table
    from zerod.bench.client import Load, Result, report

    streams = [Result(ok=True, prompt_tokens=8, output_tokens=4, ttft=0.02, latency=0.5,
                      itl=[0.01, 0.25, 0.01]),
               Result(ok=True, prompt_tokens=8, output_tokens=3, ttft=0.02, latency=0.2,
                      itl=[0.101, 0.02])]
    r = report("s", Load(), streams, 1.0, None)
    assert r["itl_gaps_over_100ms"] == 2 and r["itl_ms"]["max"] == pytest.approx(250.0)
    text = table({"s": r})
    assert "max ITL ms" in text and "gaps >100ms" in text and "250.0" in text
