"""`zerod serve --engine-process`: the engine in a process of its own beside the HTTP
server's. What the server in front of it serves is the in-process engine's (the openai
client tests run against both: test_openai_server.py, test_structured_outputs.py,
test_lora_server.py); these are the split's own cases, through the real command: the two
processes, an engine process that dies, a stop, a start that fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

openai = pytest.importorskip("openai")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _serve(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "zerod", "serve", "demo", "--engine-process",
                          "--port", str(port), "--max-model-len", "256", "--kv-pages", "256",
                          *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            pytest.fail(f"zerod serve exited {p.returncode}:\n{p.stdout.read()}")
        try:
            if _health(port)[0] == 200:
                return p, port
        except OSError:
            pass
        time.sleep(0.2)
    p.kill()
    pytest.fail("zerod serve --engine-process did not become healthy in 120 s")


def _stop(p: subprocess.Popen) -> str:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    return p.communicate(timeout=30)[0]


@pytest.fixture(scope="module")
def served():
    p, port = _serve()
    yield p, port
    _stop(p)


def test_two_processes_and_health_names_the_engine_and_its_threads(served):
    p, port = served
    status, h = _health(port)
    assert status == 200 and h["status"] == "ok"
    assert h["pid"] == p.pid                       # the supervisor's check: the process it started
    child = h["engine_pid"]
    assert child != p.pid and child in [c.pid for c in psutil.Process(p.pid).children()]
    assert "zerod-step" in h["engine_threads"] and "zerod-poller" in str(h["engine_threads"])
    assert "zerod-step" not in h["threads"]        # the server's process runs no step loop
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    chunks = list(c.completions.create(model="demo", prompt="hello", max_tokens=5, stream=True,
                                       temperature=0, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "zerod_engine_kv_pages_total" in text and "vllm:num_requests_running" in text


def test_refusals_keep_their_status_across_the_processes(served):
    _, port = served
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="demo", prompt=[5] * 200, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    assert c.completions.create(model="demo", prompt="still", max_tokens=2).usage.completion_tokens == 2


def test_a_dead_engine_process_fails_its_requests_and_health_not_the_server():
    p, port = _serve()
    try:
        child = _health(port)[1]["engine_pid"]
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = c.completions.create(model="demo", prompt="long", max_tokens=200,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(child, signal.SIGKILL)
        with pytest.raises(openai.APIError):   # the stream ends in an error event, not silently
            for _ in stream:
                pass
        deadline = time.monotonic() + 10
        while _health(port)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, h = _health(port)
        assert status == 503 and f"pid {child}" in h["error"] and "exited" in h["error"]
        with pytest.raises(openai.InternalServerError) as err:   # 503: not healthy
            c.completions.create(model="demo", prompt="x", max_tokens=1)
        assert err.value.status_code == 503
        assert p.poll() is None
    finally:
        out = _stop(p)
    assert "Traceback" not in out


def test_sigterm_drains_and_leaves_no_engine_process():
    p, port = _serve()
    child = _health(port)[1]["engine_pid"]
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model="demo", prompt="drain me", max_tokens=40,
                                  stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    os.killpg(p.pid, signal.SIGTERM)   # as systemd's stop: every process of the group
    rest = list(stream)
    assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason == "length"
    assert p.wait(60) == 0
    out = p.stdout.read()
    assert "Traceback" not in out and "zerod serve: stopped" in out
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_the_engine_process_ends_when_the_server_is_killed():
    p, port = _serve()
    child = _health(port)[1]["engine_pid"]
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(child) and time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    alive = psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    _stop(p)
    assert not alive, "the engine process outlived its server"


def test_an_engine_that_cannot_start_is_one_line_and_exit_1(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-family"}')
    port = _free_port()
    r = subprocess.run([sys.executable, "-m", "zerod", "serve", str(bad), "--engine-process",
                        "--port", str(port)], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert "zerod serve: error:" in r.stderr and "Traceback" not in r.stderr


def test_structured_outputs_compile_in_the_engine_process(served):
    """A grammar compiles in the engine's process and comes back as a handle; the output
    follows it, and a schema that does not compile is the client's 400."""
    _, port = served
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for _ in range(2):   # the second request reuses nothing it should not
        r = c.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "json"}], max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = c.completions.create(model="demo", prompt="pick", max_tokens=10,
                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="demo", prompt="x", max_tokens=5,
                             extra_body={"structured_outputs": {"regex": "(unclosed"}})
