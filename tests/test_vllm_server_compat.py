"""What a vLLM user sees from `zerod serve`'s vLLM flags on a real server (the demo
engine on the CPU, the `openai` client on loopback): --generation-config's request
defaults, --max-logprobs, the access log and --enable-log-requests."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from zerod.engine.api.server import ServerThread
from zerod.engine.generation_defaults import generation_defaults, split_max_tokens

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine():
    from zerod.engine.core.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="demo", device="cpu", max_model_len=256, kv_pages=256,
                              max_num_seqs=16, seed=0))
    eng.start()
    yield eng
    eng.shutdown(0)


def _server(engine, **kw):
    return ServerThread(engine, **kw).start()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _text(c, model, **kw):
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].message.content, r.usage.completion_tokens


def test_generation_config_defaults_apply_to_requests_that_leave_them_unset(engine, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 7, "eos_token_id": 2, "do_sample": True}))
    defaults = generation_defaults(str(tmp_path), "demo", None)
    assert defaults == {"temperature": 0.0, "max_tokens": 7}
    fields, cap = split_max_tokens(defaults, None)
    srv = _server(engine, generation_defaults=fields, default_max_tokens=cap)
    try:
        c = _client(srv)
        model = engine.model_name
        unset = [_text(c, model, seed=s) for s in (1, 2, 3)]
        greedy, n = _text(c, model, temperature=0, max_tokens=7)
        assert unset == [(greedy, 7)] * 3  # greedy by default, 7 tokens by default
        # a request that sets the field is its own: sampled with two seeds, two texts
        hot = {_text(c, model, temperature=1.5, seed=s, max_tokens=12)[0] for s in (1, 2, 3)}
        assert len(hot) > 1
    finally:
        srv.stop()


def test_generation_config_vllm_and_overrides():
    assert generation_defaults("vllm", "demo", None) == {}
    assert generation_defaults("vllm", "demo", {"top_k": -1, "top_p": 0.9}) == \
        {"top_k": -1, "top_p": 0.9}
    with pytest.raises(ValueError, match="'beam_width' is not one of"):
        generation_defaults("vllm", "demo", {"beam_width": 2})
    with pytest.raises(ValueError, match=r"temperature = 9 must be a number in \[0, 2\]"):
        generation_defaults("vllm", "demo", {"temperature": 9})
    with pytest.raises(ValueError, match="not auto, vllm nor a directory"):
        generation_defaults("/no/such/dir", "demo", None)


def test_bad_generation_config_fails_before_loading_in_one_line(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    r = subprocess.run([sys.executable, "-m", "zerod", "serve", "demo", "--generation-config",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--generation-config" in r.stderr and "top_p = 0" in r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr


def test_max_logprobs_bounds_requests(engine):
    srv = _server(engine, max_logprobs=2)
    try:
        c = _client(srv)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=engine.model_name, prompt="x", max_tokens=2, logprobs=3)
        assert e.value.body["param"] == "logprobs"
        r = c.completions.create(model=engine.model_name, prompt="x", max_tokens=2, logprobs=2)
        # the top 2, plus the sampled token when it is not among them (as vLLM)
        assert len(r.choices[0].logprobs.top_logprobs[0]) in (2, 3)
    finally:
        srv.stop()


def test_access_log_line_per_request(engine, caplog):
    srv = _server(engine)
    try:
        c = _client(srv)
        with caplog.at_level(logging.INFO, logger="zerod.access"):
            r = c.with_options().completions.with_raw_response.create(
                model=engine.model_name, prompt="hello", max_tokens=5,
                extra_body={"ignore_eos": True})
            rid = r.headers["x-request-id"]
            list(c.completions.create(model=engine.model_name, prompt="hello", max_tokens=3,
                                      stream=True, extra_body={"ignore_eos": True}))
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve("x")  # a route that is not served
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "zerod.access"]
        prompt_tokens = len(engine.tokenizer.encode("hello"))
        first = next(line for line in lines if f"id={rid}" in line)
        rec = next(r for r in caplog.records if f"id={rid}" in r.getMessage())
        assert rec.fields["status"] == 200 and rec.fields["output_tokens"] == 5  # json / journal
        assert first.startswith('"POST /v1/completions" 200 ')
        assert f"model={engine.model_name}" in first
        assert f"prompt_tokens={prompt_tokens} output_tokens=5 " in first
        assert "ttft=" in first and "ttft=-" not in first and "duration=" in first
        assert any(" output_tokens=3 " in line for line in lines)  # the stream
        assert any(line.startswith('"GET /v1/models/x" 404') and "ttft=-" in line
                   for line in lines)
    finally:
        srv.stop()


def test_access_log_off_and_request_log_on(engine, caplog):
    srv = _server(engine, access_log=False, log_requests=True, max_log_len=12)
    try:
        with caplog.at_level(logging.INFO):
            _client(srv).completions.create(model=engine.model_name, prompt="sesame",
                                            max_tokens=2, temperature=0.25)
            _client(srv).completions.create(model=engine.model_name, prompt="x" * 50,
                                            max_tokens=2)
        assert not [r for r in caplog.records if r.name == "zerod.access"]
        detail = [r.getMessage() for r in caplog.records if r.name == "zerod.requests"]
        assert len(detail) == 2 and "sesame" in detail[0] and "temperature=0.25" in detail[0]
        shown = repr(["x" * 50])   # the prompt list as logged, cut at --max-log-len 12
        assert f"prompt={shown[:12]}... ({len(shown)} characters)" in detail[1]
        assert shown[:13] not in detail[1]
    finally:
        srv.stop()


def test_a_vllm_command_line_starts_zerod_unchanged(tmp_path):
    """The flags people paste from their vLLM units, with the demo model on the CPU."""
    import os
    import re
    import signal
    import threading
    import urllib.request

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROD_API_KEY", "VLLM_API_KEY",
                                                           "JOURNAL_STREAM")}
    p = subprocess.Popen([sys.executable, "-m", "zerod", "serve", "demo", "--trust-remote-code",
                          "--served-model-name", "a", "b", "--max-model-len", "4k",
                          "--enable-chunked-prefill", "--disable-log-requests",
                          "--uvicorn-log-level", "info", "--shutdown-timeout", "2",
                          "--max-logprobs", "5", "--generation-config", str(tmp_path),
                          "-pp", "1", "--device", "cpu", "--port", "0", "--kv-pages", "600"],
                         cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
                         text=True)
    lines: list[str] = []
    try:
        url = None
        for line in p.stderr:
            lines.append(line)
            m = re.search(r"ready on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(lines)
        reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
        reader.start()
        models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        assert models["data"][0]["max_model_len"] == 4000
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        c.completions.create(model="b", prompt="hi", max_tokens=3)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="a", prompt="hi", max_tokens=3, logprobs=6)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        reader.join(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(lines)
    for flag in ("--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
                 "-pp 1"):
        assert f"zerod serve: info: {flag}: no effect: " in text
    assert "request defaults: temperature=0.6, top_p=0.95" in text
    assert re.search(r'"POST /v1/completions" 200 id=\S+ model=b prompt_tokens=\d+ '
                     r'output_tokens=3 ', text)
    assert "Traceback" not in text
