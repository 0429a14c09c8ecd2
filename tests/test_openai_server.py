"""The real engine (demo-sized tiny model on the CPU) behind the real HTTP server, driven
by the official `openai` client and by `zerod bench`. One server for the module."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.request

import aiohttp
import pytest

openai = pytest.importorskip("openai")

from zerod.engine.api.server import ServerThread
from conftest import start_engine

MAX_LEN = 256


@pytest.fixture(scope="session", params=["in-process", "engine-process"])
def live(request):
    """The engine in the server's process, and in its own (`--engine-process`)."""
    from zerod.engine.config import EngineConfig

    eng = start_engine(request.param, EngineConfig(model="demo", device="cpu", max_model_len=MAX_LEN,
                                                   kv_pages=512, max_num_seqs=64, seed=0))
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown(0)


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_openai_client_sync_all_four(live):
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in c.models.list().data] == [eng.model_name]
    r = c.completions.create(model=eng.model_name, prompt="hello there", max_tokens=5,
                             temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(eng.tokenizer.encode("hello there"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    # greedy: the stream gives the same text as the non-streamed call
    chunks = list(c.completions.create(model=eng.model_name, prompt="hello there",
                                       max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=eng.model_name, messages=msgs, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 4
    stream = c.chat.completions.create(model=eng.model_name, messages=msgs, max_tokens=4,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    # prompt as token ids, and a list of one token-id prompt
    ids = eng.tokenizer.encode("abc")
    r1 = c.completions.create(model=eng.model_name, prompt=ids, max_tokens=3, temperature=0)
    r2 = c.completions.create(model=eng.model_name, prompt=[ids], max_tokens=3, temperature=0)
    assert r1.choices[0].text == r2.choices[0].text and r1.usage.prompt_tokens == len(ids)


async def test_64_concurrent_streams_usage(live):
    eng, srv = live
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    async def one(i):
        n = 3 + i % 13
        stream = await c.completions.create(
            model=eng.model_name, prompt=f"request {i}", max_tokens=n, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        got = [ch async for ch in stream]
        assert got[-1].usage.completion_tokens == n
        assert got[-1].usage.prompt_tokens == len(eng.tokenizer.encode(f"request {i}"))
        assert sum(1 for ch in got if ch.choices and ch.choices[0].finish_reason) == 1
        return n

    done = await asyncio.gather(*(one(i) for i in range(64)))
    assert len(done) == 64
    await c.close()


async def test_random_disconnects_free_every_page(live):
    eng, srv = live
    total = _metric(srv.url, "zerod_engine_kv_pages_total")
    rng = random.Random(7)

    async def one(s, i):
        stream = rng.random() < 0.7
        body = {"prompt": [rng.randrange(10, 300) for _ in range(rng.randrange(1, 60))],
                "max_tokens": rng.randrange(1, 120), "stream": stream, "ignore_eos": True}
        cut = rng.random() < 0.5
        if not cut:
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
            return
        if stream:
            r = await s.post(srv.url + "/v1/completions", json=body)
            for _ in range(rng.randrange(1, 6)):
                await r.content.readline()
            r.close()
        else:
            try:
                await asyncio.wait_for(s.post(srv.url + "/v1/completions", json=body),
                                       rng.uniform(0.001, 0.05))
            except TimeoutError:
                pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(one(s, i) for i in range(60)))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:   # /health: an engine in its own process reports 4x a second
        h = json.load(urllib.request.urlopen(srv.url + "/health", timeout=10))
        if _metric(srv.url, "zerod_engine_kv_pages_free") == total and h["running"] == 0:
            break
        await asyncio.sleep(0.1)
    assert _metric(srv.url, "zerod_engine_kv_pages_free") == total
    assert h["status"] == "ok" and h["running"] == 0


def test_real_engine_bad_inputs_then_still_serving(live):
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=eng.model_name, prompt=[11] * (MAX_LEN + 5), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=eng.model_name, prompt=[11] * 10, max_tokens=MAX_LEN)
    # text no MAX_LEN tokens of this tokenizer could hold: refused without tokenizing it
    too_long = "x" * (eng.tokenizer.max_chars_per_token * MAX_LEN + 1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=eng.model_name, prompt=too_long, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "characters" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=eng.model_name, prompt="x", max_tokens=1,
                             extra_body={"top_k": 2**63, "min_tokens": 2**63})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=eng.model_name, prompt=[eng.vocab_size + 1], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=eng.model_name, messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=eng.model_name, prompt="x", max_tokens=1, n=129)
    assert e.value.body["param"] == "n"
    r = c.completions.create(model=eng.model_name, prompt="still here", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_bench_against_live_engine(live, tmp_path):
    from click.testing import CliRunner
    from zerod.bench.cli import bench

    eng, srv = live
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(bench, ["--base-url", srv.url, "--scenario", "streams-200",
                                   "--scenario", "hello-ttft", "--num-prompts", "8",
                                   "--max-concurrency", "8", "--input-len", "24",
                                   "--output-len", "16", "--warmup", "2", "--out", str(out),
                                   "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    s = doc["scenarios"]["streams-200"]
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["total_output_tokens"] == 8 * 16 and s["total_input_tokens"] == 8 * 24
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] < 30_000
    assert s["itl_ms"]["n"] > 0 and s["output_throughput"] > 0
    assert s["engine_cpu"]["cores"] > 0
    assert "zerod-step" in s["engine_cpu"]["threads_cores"]
    h = doc["scenarios"]["hello-ttft"]
    assert h["completed"] == 8 and h["total_output_tokens"] == 8


def test_prefix_cache_reported_in_usage(live):
    """A repeated long prompt: the second request's KV of the shared full pages comes from
    the prefix cache, reported as OpenAI's usage.prompt_tokens_details.cached_tokens, and
    the output is the same."""
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    prompt = list(range(20, 120))                   # 100 token ids: 6 full pages of 16
    first = c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=6,
                                 temperature=0, extra_body={"ignore_eos": True})
    again = c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=6,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 96
    assert again.choices[0].text == first.choices[0].text
    chunks = list(c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=2,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 96


def test_vllm_metric_names_beside_zerods(live):
    """vLLM's dashboards read vllm:* series with a model_name label: the same observations
    as zerod_engine_*, so the two agree."""
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    c.completions.create(model=eng.model_name, prompt="metrics please", max_tokens=3,
                         extra_body={"ignore_eos": True})
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    label = f'{{model_name="{eng.model_name}"}}'
    for zerod_name, vllm_name in (
            ("zerod_engine_prompt_tokens_total", "vllm:prompt_tokens_total"),
            ("zerod_engine_generation_tokens_total", "vllm:generation_tokens_total"),
            ("zerod_engine_time_to_first_token_seconds_count",
             "vllm:time_to_first_token_seconds_count"),
            ("zerod_engine_inter_token_latency_seconds_count",
             "vllm:inter_token_latency_seconds_count"),
            ("zerod_engine_e2e_request_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count"),
            ("zerod_engine_requests_running", "vllm:num_requests_running"),
            ("zerod_engine_requests_waiting", "vllm:num_requests_waiting")):
        z = re.search(rf"^{zerod_name} (\S+)$", text, re.M)
        v = re.search(rf"^{re.escape(vllm_name + label)} (\S+)$", text, re.M)
        assert z and v, (zerod_name, vllm_name)
        assert float(z.group(1)) == float(v.group(1)), vllm_name
    assert float(re.search(r"^vllm:prompt_tokens_total\S* (\S+)$", text, re.M).group(1)) > 0
    usage = float(re.search(r"^vllm:kv_cache_usage_perc\S* (\S+)$", text, re.M).group(1))
    assert 0.0 <= usage <= 1.0
    ok = sum(float(x) for x in re.findall(
        r'^vllm:request_success_total\{finished_reason="(?:stop|length|abort)",model_name='
        rf'"{eng.model_name}"\}} (\S+)$', text, re.M))
    done = sum(float(x) for x in re.findall(
        r'^zerod_engine_requests_total\{finished_reason="(?:stop|length|abort)"\} (\S+)$',
        text, re.M))
    assert ok == done >= 1


def test_min_p_one_keeps_only_the_top_token(live):
    """min_p 1.0 drops every token less likely than the top one: sampling at temperature 1
    gives the greedy text, whatever the seed."""
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=eng.model_name, prompt="min p", max_tokens=8)
    greedy = c.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kw)
    for seed in (1, 2, 3):
        r = c.completions.create(temperature=1.0, seed=seed,
                                 extra_body={"ignore_eos": True, "min_p": 1.0}, **kw)
        assert r.choices[0].text == greedy.choices[0].text
    spread = {c.completions.create(temperature=1.0, seed=s, extra_body={"ignore_eos": True},
                                   **kw).choices[0].text for s in (1, 2, 3)}
    assert len(spread) > 1  # without min_p the seeds do differ


def test_include_stop_str_in_output(live):
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=eng.model_name, prompt="stop strings", temperature=0)
    full = c.completions.create(max_tokens=12, extra_body={"ignore_eos": True}, **kw)
    text = full.choices[0].text
    stop = text[4:6]
    assert len(stop) == 2 and text.find(stop) >= 0
    cut = text[:text.find(stop)]
    for stream in (False, True):
        plain = c.completions.create(max_tokens=12, stop=[stop], stream=stream,
                                     extra_body={"ignore_eos": True}, **kw)
        kept = c.completions.create(max_tokens=12, stop=[stop], stream=stream,
                                    extra_body={"ignore_eos": True,
                                                "include_stop_str_in_output": True}, **kw)
        if stream:
            plain_t = "".join(ch.choices[0].text for ch in plain)
            kept_t = "".join(ch.choices[0].text for ch in kept)
        else:
            plain_t, kept_t = plain.choices[0].text, kept.choices[0].text
        assert plain_t == cut and kept_t == cut + stop


def test_continue_final_message_and_template_kwargs(live):
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    r = c.chat.completions.create(model=eng.model_name, messages=msgs, max_tokens=2,
                                  extra_body={"continue_final_message": True,
                                              "add_generation_prompt": False,
                                              "chat_template_kwargs": {"enable_thinking": False}})
    text = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    cut = text[:text.rfind("Sure, the") + len("Sure, the")]
    assert r.usage.prompt_tokens == len(eng.tokenizer.encode(cut, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=eng.model_name, messages=msgs[:1], max_tokens=2,
                                  extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_logit_bias_forces_and_bans_tokens(live):
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=eng.model_name, prompt="bias", max_tokens=6, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True})
    free = c.completions.create(**kw)
    ids = eng.tokenizer.encode("x", add_special_tokens=False)
    forced = c.completions.create(logit_bias={str(ids[0]): 100}, **kw)
    assert forced.choices[0].text == "x" * 6 != free.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(logit_bias={"99999999": 1}, **kw)
    assert e.value.body["param"].startswith("logit_bias")


def test_penalties_stop_repetition(live):
    """Greedy text of the random model repeats itself; a strong frequency or repetition
    penalty makes each token rarer after it appears (vLLM's definitions)."""
    eng, srv = live
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=eng.model_name, prompt=[5, 6, 7], max_tokens=40, temperature=0)

    def distinct(**extra):
        r = c.completions.create(extra_body={"ignore_eos": True, **extra}, **kw)
        return len(set(eng.tokenizer.encode(r.choices[0].text, add_special_tokens=False)))

    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain
    assert distinct(presence_penalty=2.0) > plain
    assert distinct(repetition_penalty=2.0) >= plain


# ------------------------------------------------------------------ issue 13, part 2

def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_completion_logprobs_are_raw_log_softmax(live):
    """logprobs=N: the chosen token's logprob and the top N, from the raw logits (as
    vLLM's default): greedy picks the top one, and the values match a direct forward."""
    eng, srv = live
    c = _client(srv)
    r = c.completions.create(model="demo", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                             logprobs=5, presence_penalty=1.5, frequency_penalty=1.0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    # 5 alternatives and the chosen token (keys are token texts: byte pieces may collide)
    assert all(1 <= len(d) <= 6 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    # the first token's logprob against the model itself (penalties do not change it),
    # which only the engine in this process can run
    if not hasattr(eng, "runner"):
        return
    import torch
    logits = eng.runner.score_last([5, 6, 7, 8], 2).float()
    ref = torch.log_softmax(logits, -1)
    assert abs(lp.token_logprobs[0] - ref.max().item()) < 1e-3   # no output yet: no penalty


def test_chat_logprobs_streamed_and_not(live):
    _, srv = live
    c = _client(srv)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=4, temperature=0,
                                  logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob   # greedy: the top one
    streamed = []
    for ch in c.chat.completions.create(model="demo", messages=msgs, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == \
        [(t.token, round(t.logprob, 4)) for t in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model="demo", messages=msgs, max_tokens=2, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.chat.completions.create(model="demo", messages=msgs, max_tokens=2, logprobs=True,
                                  top_logprobs=21)


def test_logprobs_batched_equal_alone(live):
    _, srv = live
    c = _client(srv)
    kw = dict(model="demo", prompt=[9, 10, 11], max_tokens=6, temperature=0.9, seed=7, logprobs=2)
    alone = c.completions.create(**kw).choices[0].logprobs.token_logprobs

    async def many():
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        others = [ac.completions.create(model="demo", prompt=[i + 1, 2, 3], max_tokens=8,
                                        temperature=1.0) for i in range(16)]
        res = await asyncio.gather(ac.completions.create(**kw), *others)
        return res[0].choices[0].logprobs.token_logprobs

    batched = asyncio.run(many())
    assert [round(v, 4) for v in batched] == [round(v, 4) for v in alone]


def test_n_choices_indexed_seeded_and_sharing_the_prompt(live):
    eng, srv = live
    c = _client(srv)
    prompt = list(range(20, 60))                      # 40 tokens: full pages to share
    r = c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=1.0,
                             seed=3, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 15
    assert r.usage.prompt_tokens_details.cached_tokens > 0    # the siblings' shared pages
    # sibling j samples with seed + j (as vLLM): choice 1 equals a lone request of seed 4
    lone = c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=1.0, seed=4)
    assert r.choices[1].text == lone.choices[0].text
    # streamed: every chunk names its choice, each choice ends once
    ends, texts = {}, {0: "", 1: "", 2: ""}
    for ch in c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=1.0,
                                   seed=3, n=3, stream=True):
        for x in ch.choices:
            texts[x.index] += x.text
            if x.finish_reason:
                ends[x.index] = x.finish_reason
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [ch.text for ch in r.choices]


def test_chat_n_streams_a_role_per_choice(live):
    _, srv = live
    c = _client(srv)
    roles, ends = set(), set()
    for ch in c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                        max_tokens=3, n=2, stream=True):
        for x in ch.choices:
            if x.delta.role:
                roles.add(x.index)
            if x.finish_reason:
                ends.add(x.index)
    assert roles == ends == {0, 1}


def test_prompt_list_times_n_and_echo(live):
    _, srv = live
    c = _client(srv)
    r = c.completions.create(model="demo", prompt=["one two", "three"], max_tokens=2, n=2,
                             temperature=0, echo=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("one two") and r.choices[2].text.startswith("three")
    assert r.choices[0].text == r.choices[1].text          # greedy siblings agree
    alone = c.completions.create(model="demo", prompt="three", max_tokens=2, temperature=0)
    assert r.choices[2].text == "three" + alone.choices[0].text
    with pytest.raises(openai.BadRequestError, match="at most 128"):
        c.completions.create(model="demo", prompt=["a"] * 65, n=2, max_tokens=1)
    # echo with logprobs: the prompt tokens' logprobs first (the first null)
    r = c.completions.create(model="demo", prompt="a", echo=True, logprobs=1, max_tokens=1)
    n = r.usage.prompt_tokens
    assert r.choices[0].logprobs.token_logprobs[0] is None
    assert len(r.choices[0].logprobs.tokens) == n + 1
