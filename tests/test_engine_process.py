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

from zerod.bench.server_cpu import CpuWindow

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


def test_a_dead_engine_process_fails_its_requests_and_ends_the_server():
    """As a process whose engine dies: requests in flight end in an error, then the
    server exits 1 naming why (each of its server processes), and the daemon restarts it
    at once."""
    p, port = _serve("--api-server-count", "2")
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
        assert p.wait(30) == 1
    finally:
        out = _stop(p)
    assert f"zerod serve: error: the engine process (pid {child}) exited with code -9" in out
    assert "Traceback" not in out


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


# --------------------------------------------------------------------- --api-server-count


@pytest.mark.parametrize("stop", ["group", "first"])
def test_several_http_server_processes_share_the_port_and_one_engine(stop):
    """stop: systemd's (SIGTERM to every process of the group) or the daemon's (to the
    process it started, which passes it on)."""
    p, port = _serve("--api-server-count", "2")
    try:
        seen = {}
        for _ in range(200):   # a new connection each: the kernel hands it to a free process
            status, h = _health(port)
            assert status == 200
            seen[h["pid"]] = h["engine_pid"]
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"one process answered 200 connections: {seen}"
        assert len(set(seen.values())) == 1 and p.pid in seen   # one engine; the first is the one started
        children = {c.pid for c in psutil.Process(p.pid).children()}
        assert set(seen) - {p.pid} <= children and set(seen.values()) <= children
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for i in range(8):   # keys of both processes meet in one engine
            r = c.completions.create(model="demo", prompt=f"n{i}", max_tokens=3)
            assert r.usage.completion_tokens == 3
        streams = [c.completions.create(model="demo", prompt="drain", max_tokens=30, stream=True,
                                        extra_body={"ignore_eos": True}) for _ in range(4)]
        firsts = [next(iter(s)) for s in streams]
        if stop == "group":
            os.killpg(p.pid, signal.SIGTERM)
        else:
            p.send_signal(signal.SIGTERM)
        for s in streams:                # every process drains its own requests
            assert list(s)[-1].choices[0].finish_reason == "length"
        assert len(firsts) == 4 and p.wait(60) == 0
        assert not [q for q in psutil.process_iter(["cmdline"])
                    if f"--port {port}" in " ".join(q.info["cmdline"] or [])
                    or q.pid in seen.values()]
    finally:
        out = _stop(p)
    assert "Traceback" not in out and out.count("zerod serve: stopped") == 2


def test_a_server_process_that_dies_leaves_the_others_and_all_end_with_the_first():
    """One of the other server processes killed: the rest serve on. The first killed
    (SIGKILL, no drain): the other servers and the engine's process end with it."""
    p, port = _serve("--api-server-count", "3")
    kids = psutil.Process(p.pid).children()
    servers = [k for k in kids if "zerod.engine.process.child" not in " ".join(k.cmdline())]
    assert len(servers) == 2 and len(kids) == 3
    engine = next(k for k in kids if k not in servers)
    cpu = CpuWindow(servers[1].pid, engine_pid=engine.pid)   # zerod bench's, answered by any server
    cpu.start()
    assert cpu.stop()["pids"] == [p.pid] + sorted(k.pid for k in kids)
    os.kill(servers[0].pid, signal.SIGKILL)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    for _ in range(10):
        assert c.completions.create(model="demo", prompt="on", max_tokens=2).usage.completion_tokens == 2
    assert _health(port)[0] == 200
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    _, alive = psutil.wait_procs(kids[:], timeout=30)
    out = _stop(p)
    assert f"(pid {servers[0].pid}) exited" in out
    assert not alive, f"outlived the first server process: {alive}"


def test_api_server_count_refuses_an_engine_in_the_servers_process(monkeypatch):
    from click.testing import CliRunner

    from zerod.engine.cli import serve

    r = CliRunner().invoke(serve, ["demo", "--api-server-count", "2", "--no-engine-process"])
    assert r.exit_code == 2 and "--no-engine-process" in r.output and r.exception is not None
    r = CliRunner().invoke(serve, ["demo", "--api-server-count", "0"])
    assert r.exit_code == 2 and "api_server_count must be >= 1" in r.output
    monkeypatch.setenv("ZEROD_API_SERVER", "1:x")   # only zerod serve sets it, for its own
    r = CliRunner().invoke(serve, ["demo"])
    assert r.exit_code == 2 and "not by hand" in r.output


def test_the_engine_gets_its_own_process_by_default_where_it_runs_on_a_gpu():
    import torch

    from zerod.engine.cli import _on_gpu

    assert _on_gpu("cuda") and _on_gpu("cuda:1") and not _on_gpu("cpu")
    assert _on_gpu("auto") == _on_gpu(None) == torch.cuda.is_available()


def test_every_server_process_lists_an_adapter_another_loaded(tmp_path):
    """LoRA adapters load through one server process; the engine tells every one."""
    from lora_support import base_and_adapters
    from zerod.engine.config import EngineConfig
    from zerod.engine.process.client import EngineClient

    base, paths, _ = base_and_adapters(tmp_path)
    first = EngineClient(EngineConfig(model=str(base), block_size=4, kv_pages=200, enable_lora=True,
                                      max_loras=2, max_lora_rank=16), servers=2)
    second = EngineClient(None, attach=(1, first.spare_channels[0].detach()))
    try:
        assert first.lora_adapters() == second.lora_adapters() == []
        first.load_lora("all8", str(paths["all8"]))
        deadline = time.monotonic() + 10
        while not second.lora_adapters() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [a.name for a in second.lora_adapters()] == ["all8"]
        second.unload_lora("all8")
        assert second.lora_adapters() == []
        while first.lora_adapters() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.lora_adapters() == []
        with pytest.raises(KeyError):
            first.unload_lora("all8")
    finally:
        second.shutdown()
        first.shutdown()
    assert first.proc.poll() is not None
