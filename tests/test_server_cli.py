"""`zerod serve` as a user runs it: flag errors without traceback, engine start errors
printed plainly, and SIGTERM draining an in-flight stream then exiting 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _zerod(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "zerod", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["serve", "--model", "/no/such/model"], "no such directory"),
    (["serve"], "Missing MODEL"),
    (["serve", "--model", "demo", "--bogus-flag"], "No such option"),
    (["serve", "--model", "demo", "--port", "http"], "--port"),
    (["serve", "--model", "demo", "--load-format", "pt"], "--load-format"),
    (["serve", "--model", "demo", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "--model", "demo", "--block-size", "12"], "power of two"),
    (["bench", "--request-rate", "x"], "--request-rate"),
])
def test_cli_flag_errors_without_traceback(args, needle):
    r = _zerod(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_engine_start_error_is_plain(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    r = _zerod("serve", "--model", str(tmp_path), "--device", "cpu", timeout=120)
    assert r.returncode == 1, r.stderr
    assert "zerod serve: error:" in r.stderr and "Traceback" not in r.stderr


def test_taken_port_fails_fast_naming_its_holder():
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        r = _zerod("serve", "--model", "demo", "--device", "cpu", "--port", str(port))
    finally:
        holder.close()
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert f"held by pid {os.getpid()}" in r.stderr  # the test process holds it
    # fast: the port is checked before anything loads (no model, no engine)
    assert "loading" not in r.stderr and "Traceback" not in r.stderr


def test_engine_flag_defaults_are_engine_config_defaults():
    import dataclasses

    from zerod.engine.cli import serve
    from zerod.engine.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    flags = {p.name: p.default for p in serve.params}
    shared = set(defaults) & set(flags) - {"model", "served_model_name"}  # no default
    assert {"max_num_seqs", "block_size", "gpu_memory_utilization", "seed"} <= shared
    assert {k: flags[k] for k in shared} == {k: defaults[k] for k in shared}


def test_sigterm_drains_stream_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k != "ZEROD_API_KEY"}
    env.update(VLLM_API_KEY="k3y", PYTHONUNBUFFERED="1")  # vLLM's variable works too
    p = subprocess.Popen([sys.executable, "-m", "zerod", "serve", "--model", "demo",
                          "--device", "cpu", "--port", "0", "--drain-timeout", "1.5",
                          "--max-model-len", "4096", "--kv-pages", "600"],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"ready on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(lines)
        threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
        auth = {"Authorization": "Bearer k3y", "Content-Type": "application/json"}
        # auth from the environment (VLLM_API_KEY): /v1 needs the key, /health does not
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/v1/models", timeout=10)
        assert e.value.code == 401
        assert json.load(urllib.request.urlopen(url + "/health", timeout=10))["status"] == "ok"
        body = json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers=auth)
        resp = urllib.request.urlopen(req, timeout=60)
        first = resp.readline()
        assert first.startswith(b"data: {")
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(urllib.error.HTTPError) as e:  # new requests: 503 while draining
            urllib.request.urlopen(urllib.request.Request(
                url + "/v1/completions", data=json.dumps({"prompt": "y"}).encode(),
                headers=auth), timeout=10)
        assert e.value.code == 503
        rest = resp.read().decode()
        assert rest.endswith("data: [DONE]\n\n")
        frames = [json.loads(f[6:]) for f in rest.split("\n\n") if f.startswith("data: {")]
        assert frames[-1]["choices"][0]["finish_reason"] in ("abort", "length")
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_start_figure_counts_from_the_process_start_not_the_boot_second():
    """`ready ... Xs after the process started` reads the process's start against the
    boot clock, tick-exact: a fresh interpreter's figure lies inside the wall time the
    parent saw (the boot time in whole seconds would add up to a second)."""
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", "from zerod.engine.cli import _since_process_start as s; print(s())"],
                       capture_output=True, text=True, timeout=60)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert 0 < float(r.stdout) <= wall
