"""The HTTP server against a fake engine: framing, errors, auth, disconnects, drain.

The fake implements `EngineLike` (engine/interface.py) in full, with a poller thread that
emits one token per request every `tick` seconds; it needs no torch, so these tests are
fast and pin the server's own behaviour. tests/test_openai_*.py run the real engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from zerod.engine.config import RequestRejected
from zerod.engine.interface import EngineLike, EngineStats
from zerod.engine.core.request import RequestOutput
from zerod.engine.api.server import ServerThread


class FakeTokenizer:
    """One token per character (plus a BOS), so one token stands for one character."""

    eos_token_ids = [0]
    max_chars_per_token = 1

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [2 + (ord(c) % 900) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i >= 2)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        s = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeMetrics:
    registry: CollectorRegistry


class FakeEngine:
    model_name = "fake"
    model_path = "/models/fake"
    max_model_len = 256
    vocab_size = 1000
    grammar_compiler = None     # no structured outputs (tests that need them set one)

    def __init__(self, tick=0.002, pages=64, max_waiting=1000):
        self.tokenizer = FakeTokenizer()
        self.tick = tick
        self.pages_total = pages
        self.max_waiting = max_waiting
        self.lock = threading.Lock()
        self.reqs = {}
        self.next_id = 0
        self.healthy = True
        self.submitted = []
        self.aborted = []
        self.registry = CollectorRegistry()
        g_free = Gauge("zerod_engine_kv_pages_free", "free pages", registry=self.registry)
        g_total = Gauge("zerod_engine_kv_pages_total", "pages", registry=self.registry)
        g_free.set_function(lambda: self.free_pages())
        g_total.set(pages)
        self.metrics = FakeMetrics(self.registry)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poller, daemon=True)
        self.thread.start()

    def free_pages(self):
        with self.lock:
            return self.pages_total - sum(r["pages"] for r in self.reqs.values())

    def submit(self, prompt_ids, params, on_output, after=None, lora=None):
        if lora is not None:    # the server only names adapters lora_adapters() lists
            raise RequestRejected(404, f"no LoRA adapter {lora!r}")
        need = (len(prompt_ids) + params.max_tokens + 15) // 16
        if need > self.pages_total:
            raise RequestRejected(400, "request can never fit in the KV pool")
        with self.lock:
            if len(self.reqs) >= self.max_waiting:
                raise RequestRejected(429, "wait line full", retry_after=2.5)
            rid = f"req-{self.next_id}"
            self.next_id += 1
            self.reqs[rid] = {"n": 0, "max": params.max_tokens, "cb": on_output,
                              "plen": len(prompt_ids), "pages": 0, "need": need,
                              "stop": params.stop}
            self.submitted.append((rid, list(prompt_ids), params))
        return rid

    def abort(self, rid):
        with self.lock:
            r = self.reqs.pop(rid, None)
            self.aborted.append(rid)
        if r is not None:
            r["cb"](RequestOutput(rid, [], "", True, "abort", r["plen"], r["n"]))

    def stats(self):
        with self.lock:
            running = sum(1 for r in self.reqs.values() if r["pages"])
            return EngineStats(
                running=running, waiting=len(self.reqs) - running,
                kv_pages_total=self.pages_total,
                kv_pages_free=self.pages_total - sum(r["pages"] for r in self.reqs.values()),
                healthy=self.healthy, device="cpu", model=self.model_name,
                max_model_len=self.max_model_len, steps=0, cuda_graphs=False)

    def metrics_text(self):
        return generate_latest(self.registry)

    def _poller(self):
        while not self.stop.is_set():
            time.sleep(self.tick)
            outs = []
            with self.lock:
                used = sum(r["pages"] for r in self.reqs.values())
                for rid, r in list(self.reqs.items()):
                    if not r["pages"]:
                        if used + r["need"] > self.pages_total:
                            continue
                        r["pages"] = r["need"]
                        used += r["need"]
                    r["n"] += 1
                    n = r["n"]
                    text = "é" if n % 5 == 0 else f"t{n} "
                    fin = n >= r["max"]
                    if fin:
                        del self.reqs[rid]
                    outs.append((r["cb"], RequestOutput(rid, [n], text, fin,
                                                        "length" if fin else None,
                                                        r["plen"], n)))
            for cb, o in outs:
                cb(o)

    def shutdown(self, drain_timeout=0):
        self.stop.set()

    def lora_adapters(self):
        return []

    def load_lora(self, name, path):
        from zerod.engine.config import EngineError
        raise EngineError("LoRA is not enabled on this engine (start it with --enable-lora)")

    def unload_lora(self, name):
        raise KeyError(name)


def test_fake_engine_is_engine_like():
    eng = FakeEngine()
    try:
        assert isinstance(eng, EngineLike)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def fake():
    eng = FakeEngine()
    srv = ServerThread(eng, served_model_names=["fake", "fake-alias"]).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def fake_auth():
    eng = FakeEngine()
    srv = ServerThread(eng, api_key="sekret").start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


async def _post(url, body, headers=None, raw=None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body)
        async with s.post(url, data=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})}) as r:
            return r.status, dict(r.headers), await r.read()


async def _sse_events(url, body, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")
    assert frames[-1] == ""
    events = []
    for f in frames[:-1]:
        assert f.startswith("data: "), f
        payload = f[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_models_and_health(fake):
    eng, srv = fake
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/v1/models") as r:
            body = await r.json()
            assert r.status == 200
            assert [m["id"] for m in body["data"]] == ["fake", "fake-alias"]
            assert body["object"] == "list" and body["data"][0]["object"] == "model"
        async with s.get(srv.url + "/health") as r:
            h = await r.json()
            assert r.status == 200 and h["status"] == "ok" and h["pid"] > 0
            assert h["kv_pages_total"] == 64 and h["vocab_size"] == 1000
            assert "engine_pid" not in h and "engine_threads" not in h   # in this process
        async with s.get(srv.url + "/metrics") as r:
            assert r.status == 200
            assert "zerod_engine_kv_pages_free" in await r.text()


async def test_what_the_engine_lacks_is_refused_through_its_interface(fake):
    """An engine without structured outputs or LoRA says so through EngineLike: the
    server refuses the field by name and lists no adapters."""
    eng, srv = fake
    status, _, raw = await _post(srv.url + "/v1/chat/completions",
                                 {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2, "response_format": {"type": "json_object"}})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "response_format"
    assert "not supported by this server" in err["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/health") as r:
            assert (await r.json())["lora_adapters"] == []


async def test_completion_stream_framing(fake):
    eng, srv = fake
    ev = await _sse_events(srv.url + "/v1/completions",
                           {"model": "fake", "prompt": "hi", "max_tokens": 7, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]"
    usage = ev[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0}}
    chunks = ev[:-2]
    assert all(c["object"] == "text_completion" and "usage" in c and c["usage"] is None
               for c in chunks)
    assert len({c["id"] for c in ev[:-1]}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "t1 t2 t3 t4 ét6 t7 "


async def test_chat_stream_role_first_no_usage(fake):
    eng, srv = fake
    ev = await _sse_events(srv.url + "/v1/chat/completions",
                           {"model": "fake-alias", "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 3, "stream": True})
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "t1 t2 t3 "
    assert chunks[0]["model"] == "fake-alias"


async def test_nonstream_usage(fake):
    eng, srv = fake
    st, _, raw = await _post(srv.url + "/v1/chat/completions",
                             {"model": "fake", "messages": [{"role": "user", "content": "ab"}],
                              "max_completion_tokens": 4})
    body = json.loads(raw)
    assert st == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t1 t2 t3 t4 "}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    st, _, raw = await _post(srv.url + "/v1/completions",
                             {"model": "fake", "prompt": [[5, 6, 7]], "max_tokens": 2,
                              "temperature": 0, "seed": 3, "stop": "zz"})
    body = json.loads(raw)
    assert st == 200 and body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                           "total_tokens": 5,
                                           "prompt_tokens_details": {"cached_tokens": 0}}
    rid, ids, params = eng.submitted[-1]
    assert ids == [5, 6, 7] and params.temperature == 0 and params.seed == 3
    assert params.stop == ["zz"] and params.max_tokens == 2


BAD = [
    # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1,2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 255}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": ["x"] * 64, "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": ["a"] * 129}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 5000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "y" * 300, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     400, "tools[0].type"),  # a tool without its type
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    # every numeric field is bounded by what the engine can do (vocab 1000, context 256)
    ("/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 1001}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**63}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 257}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 8}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -2**63 - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2**70}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(257))}, 400,
     "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 1025}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**64}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1e308 * 10}, 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1e9}}, 400, "logit_bias.5"),
    ("/v1/completions", {"prompt": list(range(1, 257))}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2**63}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**30}, 400, "max_completion_tokens"),
    # JSON nested past the limit: a 400 at once, not a stack overflow
    ("/v1/completions", b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, None),
    ("/v1/completions", {"prompt": "x", "frobnicate": json.loads("[" * 65 + "]" * 65)}, 400,
     None),
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{i}-{b[0].split('/')[-1]}" for i, b in enumerate(BAD)])
async def test_bad_inputs(fake, path, body, status, param):
    eng, srv = fake
    raw = body if isinstance(body, bytes) else None
    st, headers, data = await _post(srv.url + path, body, raw=raw)
    assert st == status, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    # the server still answers
    st, _, _ = await _post(srv.url + "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert st == 200


async def test_unknown_field_refused_metadata_accepted_and_404_405(fake):
    eng, srv = fake
    st, _, raw = await _post(srv.url + "/v1/completions",
                             {"prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1}})
    err = json.loads(raw)["error"]
    assert st == 400 and err["param"] == "frobnicate" and err["code"] == "unknown_field"
    st, _, raw = await _post(srv.url + "/v1/completions",
                             {"prompt": "x", "max_tokens": 1, "user": "me", "store": False,
                              "metadata": {"k": "v"}, "presence_penalty": 0})
    assert st == 200, raw
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/v1/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        async with s.get(srv.url + "/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()


async def test_rejected_maps_to_400_and_429(fake):
    eng, srv = fake
    eng.pages_total, saved = 1, eng.pages_total
    try:
        st, _, raw = await _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 100})
        assert st == 400 and "never fit" in json.loads(raw)["error"]["message"]
    finally:
        eng.pages_total = saved
    eng.max_waiting = 0
    try:
        st, headers, raw = await _post(srv.url + "/v1/completions", {"prompt": "x"})
        assert st == 429 and headers["Retry-After"] == "3"
        assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    finally:
        eng.max_waiting = 1000


async def test_auth(fake_auth):
    eng, srv = fake_auth
    body = {"prompt": "x", "max_tokens": 1}
    for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                {"Authorization": "Basic sekret"}):
        st, headers, raw = await _post(srv.url + "/v1/completions", body, headers=hdr)
        assert st == 401, hdr
        assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    st, _, _ = await _post(srv.url + "/v1/completions", body,
                           headers={"Authorization": "Bearer sekret"})
    assert st == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/v1/models") as r:
            assert r.status == 401
        for path in ("/health", "/metrics"):
            async with s.get(srv.url + path) as r:
                assert r.status == 200, path


async def test_disconnects_free_pages_and_abort(fake):
    eng, srv = fake
    eng.tick, saved = 0.01, eng.tick
    try:
        async def one(i):
            async with aiohttp.ClientSession() as s:
                req = s.post(srv.url + "/v1/completions",
                             json={"prompt": "abc", "max_tokens": 200 - i, "stream": i % 2 == 0})
                if i % 2 == 0:
                    r = await req
                    await r.content.readline()
                    await r.content.readline()
                    r.close()  # drops the connection mid-stream
                else:  # a non-streamed request whose client gives up waiting
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(req, 0.1)
        n_sub = len(eng.submitted)
        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(12)))
        # Left alone each request would run >= 1.9 s; aborted, its pages are back at once.
        # (On a loaded machine a client may give up before its request was even submitted.)
        while time.monotonic() - t0 < 1.5:
            mine = [rid for rid, _, _ in eng.submitted[n_sub:]]
            if eng.free_pages() == eng.pages_total and set(mine) <= set(eng.aborted):
                break
            await asyncio.sleep(0.02)
        mine = [rid for rid, _, _ in eng.submitted[n_sub:]]
        assert mine and set(mine) <= set(eng.aborted)
        assert eng.free_pages() == eng.pages_total
    finally:
        eng.tick = saved
    st, _, _ = await _post(srv.url + "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert st == 200


async def test_many_concurrent_streams_batched_wakeups(fake):
    eng, srv = fake
    router = srv.server.router
    w0, d0 = router.wakeups, router.delivered

    async def one(s, i):
        async with s.post(srv.url + "/v1/completions",
                          json={"prompt": "p", "max_tokens": 20, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            raw = (await r.read()).decode()
        ev = [json.loads(f[6:]) for f in raw.split("\n\n") if f and f != "data: [DONE]"]
        return ev[-1]["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        counts = await asyncio.gather(*(one(s, i) for i in range(100)))
    assert counts == [20] * 100
    # many outputs per wake-up: the poller's bursts are handed over together
    assert router.delivered - d0 >= 2000
    assert (router.delivered - d0) / (router.wakeups - w0) > 5


def test_drain_ends_stream_cleanly():
    eng = FakeEngine(tick=0.01)
    srv = ServerThread(eng, drain_timeout=0.3).start()
    got = {}

    async def client():
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 10_000 // 100, "stream": True}) as r:
                await r.content.readline()
                threading.Thread(target=srv.stop).start()
                await asyncio.sleep(0.1)
                async with s.get(srv.url + "/health") as h:
                    got["health"] = h.status
                async with s.post(srv.url + "/v1/completions", json={"prompt": "x"}) as h:
                    got["new"] = h.status
                got["raw"] = (await r.read()).decode()

    asyncio.run(client())
    eng.shutdown()
    assert got["health"] == 503 and got["new"] == 503
    assert got["raw"].endswith("data: [DONE]\n\n")
    frames = [json.loads(f[6:]) for f in got["raw"].split("\n\n") if f.startswith("data: {")]
    assert frames[-1]["choices"][0]["finish_reason"] in ("abort", "length")


async def test_health_follows_engine_and_engine_503(fake):
    eng, srv = fake
    eng.healthy = False
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "unhealthy"
    finally:
        eng.healthy = True
    orig = eng.submit

    def refuse(*a, **k):
        raise RequestRejected(503, "the engine is shutting down", retry_after=5.0)

    eng.submit = refuse
    try:
        st, headers, raw = await _post(srv.url + "/v1/completions", {"prompt": "x"})
        assert st == 503 and json.loads(raw)["error"]["type"] == "service_unavailable"
        assert headers["Retry-After"] == "5"
    finally:
        eng.submit = orig
    async with aiohttp.ClientSession() as s, s.get(srv.url + "/health") as r:
        assert r.status == 200


def _raw_stream(port, version):
    import socket

    body = json.dumps({"prompt": "hi", "max_tokens": 12, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (version, len(body), body))
    s.settimeout(10)
    buf = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        buf += d
    s.close()
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head.decode(), rest


def _dechunk(rest):
    out = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert rest == b"\r\n"
            return out
        out += rest[:n]
        assert rest[n:n + 2] == b"\r\n"
        rest = rest[n + 2:]


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_stream_wire_framing(fake, version):
    eng, srv = fake
    head, rest = _raw_stream(srv.port, version)
    assert " 200 " in head.splitlines()[0]
    if version == b"1.1":
        assert "Transfer-Encoding: chunked" in head
        body = _dechunk(rest)
    else:
        assert "chunked" not in head
        body = rest
    frames = body.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    texts = [json.loads(f[6:])["choices"][0]["text"] for f in frames[:-2]]
    assert "".join(texts) == "t1 t2 t3 t4 ét6 t7 t8 t9 ét11 t12 "
