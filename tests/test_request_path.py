"""A tiny streamed request on an idle engine (the "Hello" TTFT path), as a client sees it:
it completes and streams correctly one request after another, in each shape of a plain
stream's first chunk (completions, chat's role chunk, n > 1 with echo's prompts), whether
the drain or aiohttp writes that chunk; a request the engine refuses still gets an error
in OpenAI's shape, not a started stream. gpu/request_path.py, the per-stage timing of the
same request, runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from test_server_fake import FakeEngine, _post
from zerod.engine.api.server import ServerThread

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def idle():
    from zerod.engine.config import EngineConfig
    from zerod.engine.core.engine import Engine

    eng = Engine(EngineConfig(model="demo", device="cpu", seed=0))
    eng.start()
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown(0)


async def _stream(url: str, body: dict) -> list:
    """The stream's events in order: parsed JSON chunks, then the string '[DONE]'."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.strip()]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def test_hello_requests_one_after_another_each_stream_one_token(idle):
    eng, srv = idle
    vocab = eng.vocab_size
    for i in range(12):
        prompt = [5 + i % (vocab - 10), 7]
        ev = await _stream(srv.url + "/v1/completions",
                           {"prompt": prompt, "max_tokens": 1, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}})
        assert ev[-1] == "[DONE]"
        chunks = [e for e in ev[:-1] if e["choices"]]
        assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "length"
        assert chunks[0]["id"].startswith("cmpl-")
        usage = ev[-2]["usage"]
        assert usage["prompt_tokens"] == 2 and usage["completion_tokens"] == 1
    assert eng.stats().running == 0


async def test_chat_stream_on_an_idle_engine_starts_with_the_role(idle):
    eng, srv = idle
    ev = await _stream(srv.url + "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1,
                        "stream": True, "ignore_eos": True})
    assert ev[-1] == "[DONE]"
    first, last = ev[0]["choices"][0], ev[-2]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert last["finish_reason"] == "length"
    assert {e["id"] for e in ev[:-1]} == {ev[0]["id"]} and ev[0]["id"].startswith("chatcmpl-")


async def test_stream_of_two_choices_with_echo_starts_with_each_prompt(idle):
    eng, srv = idle
    ev = await _stream(srv.url + "/v1/completions",
                       {"prompt": "Hello", "max_tokens": 2, "n": 2, "echo": True, "stream": True,
                        "ignore_eos": True})
    assert ev[-1] == "[DONE]"
    by_choice: dict[int, list] = {0: [], 1: []}
    for e in ev[:-1]:
        for c in e["choices"]:
            by_choice[c["index"]].append(c)
    for cs in by_choice.values():
        assert cs[0]["text"] == "Hello"
        assert cs[-1]["finish_reason"] == "length"


async def test_a_refused_stream_answers_an_error_not_a_stream():
    eng = FakeEngine(max_waiting=0)
    srv = ServerThread(eng).start()
    try:
        st, headers, raw = await _post(srv.url + "/v1/completions",
                                       {"prompt": "x", "max_tokens": 1, "stream": True})
        assert st == 429 and headers["Content-Type"].startswith("application/json")
        assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    finally:
        srv.stop()
        eng.shutdown()


def test_request_path_bench_prints_every_stage(tmp_path):
    sys.path.insert(0, str(ROOT / "gpu"))
    try:
        from request_path import STAGES
    finally:
        sys.path.remove(str(ROOT / "gpu"))

    out = tmp_path / "path.json"
    r = subprocess.run([sys.executable, "gpu/request_path.py", "-n", "6", "--warmup", "2",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for _, what in STAGES:
        assert what in r.stdout
    doc = json.loads(out.read_text())
    assert doc["requests"] == 6 and doc["device"] == "cpu"
    assert all(s["p50_us"] is not None and s["p50_us"] >= 0 for s in doc["stages"])
    assert 0 < doc["forward_p50_us"] < doc["ttft_p50_us"]
    assert 0 < doc["ttft_without_forward_p50_us"] < doc["ttft_p50_us"]


@pytest.mark.parametrize("headers_at_prepare", [True, False])
async def test_streams_are_whole_whether_aiohttp_sends_the_headers_at_prepare_or_not(
        monkeypatch, headers_at_prepare):
    from aiohttp import web

    if not hasattr(web.StreamResponse, "_send_headers_immediately"):
        pytest.skip("this aiohttp has no switch for when a stream's headers go out")
    # an aiohttp that holds the headers back until the first body write: the first chunk
    # then goes through aiohttp's write(), the later ones through the drain
    monkeypatch.setattr(web.StreamResponse, "_send_headers_immediately", headers_at_prepare)
    eng = FakeEngine()
    srv = ServerThread(eng).start()
    try:
        for body in ({"prompt": "hi", "max_tokens": 1, "stream": True},
                     {"prompt": "hi", "max_tokens": 5, "stream": True,
                      "stream_options": {"include_usage": True}},
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                      "stream": True}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            ev = await _stream(srv.url + path, body)
            assert ev[-1] == "[DONE]"
            chunks = [e for e in ev[:-1] if e["choices"]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            if "messages" in body:
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert len(chunks) == 1 + 3
            else:
                assert len(chunks) == body["max_tokens"]
            if "stream_options" in body:
                assert ev[-2]["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()
        eng.shutdown()
