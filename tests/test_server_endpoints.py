"""/tokenize, /detokenize, /version, CORS and X-Request-Id, against the fake engine
(one token per character), and the CORS flags of `zerod serve`."""

from __future__ import annotations

import aiohttp
import pytest
from test_server_fake import FakeEngine, _post
from zerod.engine.api.cors import CorsPolicy
from zerod.engine.api.server import ServerThread


@pytest.fixture(scope="module")
def fake():
    eng = FakeEngine()
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def strict_cors():
    eng = FakeEngine()
    srv = ServerThread(eng, api_key="k", cors=CorsPolicy(
        ("https://app.example",), ("GET", "POST"), ("authorization", "content-type"),
        allow_credentials=True)).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


async def _json_post(url, body, headers=None):
    st, h, raw = await _post(url, body, headers)
    import json
    return st, h, json.loads(raw)


async def test_tokenize_prompt_and_messages(fake):
    eng, srv = fake
    st, _, b = await _json_post(srv.url + "/tokenize", {"prompt": "abc"})
    assert st == 200 and b["tokens"] == eng.tokenizer.encode("abc") and b["count"] == 4
    assert b["max_model_len"] == 256 and b["token_strs"] is None
    st, _, b = await _json_post(srv.url + "/tokenize", {"prompt": "ab", "add_special_tokens": False,
                                                        "return_token_strs": True})
    assert b["tokens"] == [2 + ord("a"), 2 + ord("b")]
    assert b["token_strs"] == [eng.tokenizer.decode([t]) for t in b["tokens"]]
    msgs = [{"role": "user", "content": "hi"}]
    st, _, b = await _json_post(srv.url + "/tokenize", {"messages": msgs})
    text = eng.tokenizer.apply_chat_template(msgs)
    assert st == 200 and b["tokens"] == eng.tokenizer.encode(text, add_special_tokens=False)
    b_ids = b["tokens"]
    st, _, b = await _json_post(srv.url + "/detokenize", {"tokens": b_ids})
    assert st == 200 and b["prompt"] == eng.tokenizer.decode(b_ids)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 5000]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
])
async def test_tokenize_bad_input(fake, path, body, param):
    eng, srv = fake
    st, _, b = await _json_post(srv.url + path, body)
    assert st in (400, 404) and b["error"]["param"] == param, b


async def test_version(fake):
    eng, srv = fake
    from zerod import __version__
    async with aiohttp.ClientSession() as s, s.get(srv.url + "/version") as r:
        assert r.status == 200 and (await r.json()) == {"version": __version__}


def _rid(headers: dict) -> str:
    """The X-Request-Id header (aiohttp spells it X-Request-ID)."""
    return {k.lower(): v for k, v in headers.items()}["x-request-id"]


async def test_request_id_echoed_or_made_on_every_answer(fake):
    eng, srv = fake
    url = srv.url + "/v1/completions"
    st, h, _ = await _post(url, {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": "abc-123"})
    assert st == 200 and _rid(h) == "abc-123"
    st, h, _ = await _post(url, {"prompt": 5}, {"X-Request-Id": "bad-one"})
    assert st == 400 and _rid(h) == "bad-one"  # errors carry it too
    st, h1, _ = await _post(url, {"prompt": "x", "max_tokens": 1})
    st, h2, _ = await _post(url, {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": "x" * 500})
    assert len(_rid(h1)) == 32 and len(_rid(h2)) == 32  # made anew
    assert _rid(h1) != _rid(h2)
    async with aiohttp.ClientSession() as s:  # a stream: the header goes out before the body
        async with s.post(url, json={"prompt": "x", "max_tokens": 3, "stream": True},
                          headers={"X-Request-Id": "stream-1"}) as r:
            assert r.headers["X-Request-Id"] == "stream-1"
            await r.read()


async def test_cors_default_allows_any_origin(fake):
    eng, srv = fake
    async with aiohttp.ClientSession() as s:
        async with s.options(srv.url + "/v1/chat/completions", headers={
                "Origin": "https://x.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization"}) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
        async with s.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers={"Origin": "https://x.example"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        async with s.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers  # no Origin, no CORS


async def test_cors_restricted(strict_cors):
    eng, srv = strict_cors
    url = srv.url + "/v1/completions"

    async def preflight(origin, method="POST", headers="content-type"):
        async with aiohttp.ClientSession() as s, s.options(url, headers={
                "Origin": origin, "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": headers}) as r:
            return r.status, r.headers

    st, h = await preflight("https://app.example")  # no API key needed for a preflight
    assert st == 200 and h["Access-Control-Allow-Origin"] == "https://app.example"
    assert h["Access-Control-Allow-Credentials"] == "true"
    assert (await preflight("https://evil.example"))[0] == 400
    assert (await preflight("https://app.example", method="DELETE"))[0] == 400
    assert (await preflight("https://app.example", headers="x-custom"))[0] == 400
    st, h, _ = await _post(url, {"prompt": "x", "max_tokens": 1},
                           {"Origin": "https://evil.example", "Authorization": "Bearer k"})
    assert st == 200 and "Access-Control-Allow-Origin" not in h
    st, h, _ = await _post(url, {"prompt": "x", "max_tokens": 1},
                           {"Origin": "https://app.example", "Authorization": "Bearer k"})
    assert h["Access-Control-Allow-Origin"] == "https://app.example"


def test_serve_cors_flags_refuse_non_json_lists():
    from click.testing import CliRunner
    from zerod.engine.cli import serve

    r = CliRunner().invoke(serve, ["--model", "demo", "--allowed-origins", "https://a"])
    assert r.exit_code == 2 and "not a JSON list of strings" in r.output
    assert "Traceback" not in r.output
