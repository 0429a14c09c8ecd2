"""ZEROD_FAULT on the CPU: a stalled step loop that still answers /health, greedy
outputs that change after the weights are perturbed, a malformed value refused
before the model loads, and the stack dump the daemon asks for."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from zerod.engine.config import EngineError
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams
from zerod.engine.core.faults import ENV, Fault, parse_fault
from zerod.engine.demo import generate, make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", seed=11)
    return d


def _engine(ckpt, monkeypatch, fault: str) -> Engine:
    monkeypatch.setenv(ENV, fault)
    e = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=200, max_model_len=128, max_num_seqs=8))
    monkeypatch.delenv(ENV)
    e.start()
    return e


def _prompts(k: int) -> list[list[int]]:
    r = random.Random(3)
    return [[r.randrange(5, 380) for _ in range(12)] for _ in range(k)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_values_it_takes_and_the_ones_it_refuses():
    assert parse_fault("stall-after-steps:40") == Fault("stall-after-steps", 40)
    assert parse_fault(" corrupt-after-steps:0 ") == Fault("corrupt-after-steps", 0)
    for bad in ("stall", "stall-after-steps:", "stall-after-steps:-1", "hang-after-steps:3", "stall-after-steps:1x"):
        with pytest.raises(EngineError) as ei:
            parse_fault(bad)
        assert ENV in str(ei.value) and "stall-after-steps:N" in str(ei.value)


def test_corrupt_after_steps_changes_greedy_outputs(ckpt, monkeypatch):
    clean = Engine(EngineConfig(model=str(ckpt), block_size=4, kv_pages=200, max_model_len=128, max_num_seqs=8))
    clean.start()
    try:
        want = [r["token_ids"] for r in generate(clean, _prompts(3), GREEDY)]
        assert want == [r["token_ids"] for r in generate(clean, _prompts(3), GREEDY)]  # greedy repeats
    finally:
        clean.shutdown(0)
    bad = _engine(ckpt, monkeypatch, "corrupt-after-steps:1")
    try:
        generate(bad, [_prompts(1)[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        got = [r["token_ids"] for r in generate(bad, _prompts(3), GREEDY)]
    finally:
        bad.shutdown(0)
    assert all(g != w for g, w in zip(got, want)), "every greedy answer changes after the perturbation"


def test_stall_after_steps_stops_tokens_while_health_holds(ckpt, monkeypatch):
    e = _engine(ckpt, monkeypatch, "stall-after-steps:5")
    outs = []
    try:
        e.submit(_prompts(1)[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), outs.append)
        time.sleep(1.0)
        steps, n = e.stats().steps, len(outs)
        time.sleep(0.5)
        st = e.stats()
        assert st.steps == steps == 5 and len(outs) == n < 50  # nothing more comes
        assert st.healthy and st.running == 1  # /health's answer: alive, a request running
        assert e.poller.last_step is not None and e.poller.last_step["decodes"] == 1
    finally:
        t0 = time.monotonic()
        e.shutdown(0)
    assert time.monotonic() - t0 < 10  # a stalled loop still stops on shutdown


def test_serve_refuses_a_malformed_fault_before_loading(tmp_path):
    env = {**os.environ, ENV: "stall-after:3"}
    p = subprocess.run([sys.executable, "-m", "zerod", "serve", "--model", "demo", "--device", "cpu", "--port", "0"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "ZEROD_FAULT='stall-after:3': must be one of" in p.stderr and "Traceback" not in p.stderr


def test_sigusr2_appends_every_thread_s_stack_to_the_stack_file(tmp_path):
    out = tmp_path / "stacks.txt"
    code = textwrap.dedent("""
        import threading, time
        from zerod.engine.core.stack_dump import register_from_env
        register_from_env()
        def zerod_step_loop_body():
            time.sleep(60)
        threading.Thread(target=zerod_step_loop_body, name="zerod-step", daemon=True).start()
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "ZEROD_STACK_FILE": str(out)},
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(p.pid, signal.SIGUSR2)
        end = time.monotonic() + 5
        while "zerod_step_loop_body" not in (out.read_text() if out.exists() else "") and time.monotonic() < end:
            time.sleep(0.05)
        assert "zerod_step_loop_body" in out.read_text() and p.poll() is None  # dumped, still running
    finally:
        p.kill()
        p.wait()


@pytest.mark.gpu
def test_corrupt_after_steps_reaches_cuda_graph_replays(tmp_path, monkeypatch):
    """On the GPU the decode steps replay CUDA graphs captured before the fault: the
    perturbation is in place, so the graphs read the rotated head and every greedy
    answer changes."""
    make_checkpoint(tmp_path, "llama", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    dtype="bfloat16", seed=5)
    cfg = dict(model=str(tmp_path), device="cuda", dtype="bfloat16", kv_pages=256, max_model_len=256,
               max_num_seqs=8)
    clean = Engine(EngineConfig(**cfg))
    assert clean.runner.graphs  # the graphs are what this test is about
    clean.start()
    try:
        want = [r["token_ids"] for r in generate(clean, _prompts(3), GREEDY)]
    finally:
        clean.shutdown(0)
    monkeypatch.setenv(ENV, "corrupt-after-steps:1")
    bad = Engine(EngineConfig(**cfg))
    monkeypatch.delenv(ENV)
    bad.start()
    try:
        generate(bad, [_prompts(1)[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        got = [r["token_ids"] for r in generate(bad, _prompts(3), GREEDY)]
    finally:
        bad.shutdown(0)
    assert all(g != w for g, w in zip(got, want))
