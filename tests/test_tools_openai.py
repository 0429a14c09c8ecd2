"""Tools with the official `openai` client against the real engine (random-weight demo
model): required and named choices are valid because structured outputs enforce them;
auto reads the output with the server's --tool-call-parser; tool messages reach the
chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from zerod.engine.api.server import ServerThread

# A template that renders tools, assistant tool calls and tool results (served as
# --chat-template would: Tokenizer.set_chat_template).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COLOR = {"type": "function", "function": {"name": "paint", "description": "Paint a wall",
         "parameters": {"type": "object", "additionalProperties": False,
                        "required": ["color", "coats"],
                        "properties": {"color": {"enum": ["red", "blue"]},
                                       "coats": {"type": "integer", "minimum": 1,
                                                 "maximum": 3}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [COLOR, CLOCK]
MSGS = [{"role": "user", "content": "paint it"}]


@pytest.fixture(scope="module")
def live():
    from zerod.engine.core.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="demo", device="cpu", max_model_len=512, kv_pages=1024,
                              max_num_seqs=32, seed=0))
    eng.tokenizer.set_chat_template(TEMPLATE)
    eng.start()
    srv = ServerThread(eng).start()
    auto = ServerThread(eng, tool_parser="hermes").start()
    yield eng, srv, auto
    auto.stop()
    srv.stop()
    eng.shutdown(0)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _check_call(call, tools=TOOLS):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_required_always_calls_a_given_tool(live):
    _, srv, _ = live
    c = _client(srv)
    for seed in range(6):
        r = c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                      tool_choice="required", max_tokens=200, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None and ch.message.tool_calls
        for call in ch.message.tool_calls:
            _check_call(call)


def test_named_function_gets_valid_arguments(live):
    _, srv, _ = live
    for seed in range(4):
        r = _client(srv).chat.completions.create(
            model="demo", messages=MSGS, tools=TOOLS, max_tokens=100, seed=seed,
            tool_choice={"type": "function", "function": {"name": "paint"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "paint" and r.choices[0].finish_reason == "stop"
        _check_call(call)


def test_streamed_tool_call_deltas(live):
    _, srv, _ = live
    c = _client(srv)
    for choice in ({"type": "function", "function": {"name": "paint"}}, "required"):
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                               tool_choice=choice, max_tokens=200, seed=5,
                                               stream=True,
                                               stream_options={"include_usage": True}):
            if not chunk.choices:
                assert chunk.usage.completion_tokens > 0
                continue
            d = chunk.choices[0].delta
            reasons.append(chunk.choices[0].finish_reason)
            for tc in d.tool_calls or []:   # OpenAI's accumulation: id/name once, args appended
                acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                acc["id"] = tc.id or acc["id"]
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
        assert reasons[-1] == ("stop" if isinstance(choice, dict) else "tool_calls")
        assert calls and all(a["id"] for a in calls.values())
        spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for a in calls.values():
            jsonschema.validate(json.loads(a["arguments"]), spec[a["name"]])



def test_each_of_n_choices_gets_its_own_calls_and_logprobs(live):
    _, srv, _ = live
    r = _client(srv).chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                             tool_choice="required", max_tokens=200, seed=2,
                                             n=3, logprobs=True, top_logprobs=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            _check_call(call)
        assert ch.logprobs.content and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)


def test_streamed_tool_calls_of_n_choices(live):
    _, srv, _ = live
    for choice in ({"type": "function", "function": {"name": "paint"}}, "required"):
        calls: dict[tuple[int, int], dict] = {}
        reasons: dict[int, str] = {}
        for chunk in _client(srv).chat.completions.create(
                model="demo", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=200,
                seed=7, n=2, stream=True):
            ch = chunk.choices[0]
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
            for tc in ch.delta.tool_calls or []:
                acc = calls.setdefault((ch.index, tc.index), {"name": "", "arguments": ""})
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
        want = "stop" if isinstance(choice, dict) else "tool_calls"
        assert reasons == {0: want, 1: want}
        assert {i for i, _ in calls} == {0, 1}
        spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for a in calls.values():
            jsonschema.validate(json.loads(a["arguments"]), spec[a["name"]])


def test_streamed_tools_with_logprobs_are_refused(live):
    _, srv, _ = live
    with pytest.raises(openai.BadRequestError) as ei:
        _client(srv).chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                             tool_choice="required", max_tokens=5,
                                             logprobs=True, stream=True)
    assert ei.value.body["param"] == "logprobs" and ei.value.body["code"] == "unsupported"

def test_tool_results_in_the_conversation_reach_the_template(live):
    eng, srv, _ = live
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "paint", "arguments": '{"color": "red", "coats": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = _client(srv).chat.completions.create(model="demo", messages=msgs, tools=TOOLS,
                                             tool_choice="none", max_tokens=3)
    assert r.choices[0].message.tool_calls is None
    rendered = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "paint it"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "paint", "arguments": {"color": "red", "coats": 2}}}]},
         {"role": "tool", "content": "done", "tool_call_id": "call_1"}], tools=TOOLS)
    n = len(eng.tokenizer.encode(rendered, add_special_tokens=False))
    assert r.usage.prompt_tokens == n
    assert 'Tools: paint, clock' in rendered and '"arguments": {"color": "red"' in rendered
    assert "[call_1] done" in rendered


def test_auto_needs_the_parser_flags_and_then_parses(live):
    _, srv, auto = live
    with pytest.raises(openai.BadRequestError) as ei:
        _client(srv).chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                             max_tokens=5)
    assert ei.value.body["param"] == "tool_choice" and "--tool-call-parser" in \
        ei.value.body["message"]
    # with the parser: the random model writes no <tool_call>, so the output is content
    r = _client(auto).chat.completions.create(model="demo", messages=MSGS, tools=TOOLS,
                                              max_tokens=8, seed=1)
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.message.content and ch.finish_reason == "length"


def test_bad_tool_requests_are_400s(live):
    _, srv, _ = live
    c = _client(srv)
    for kw, param in (
            (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
            (dict(tool_choice="required", response_format={"type": "json_object"}),
             "tool_choice"),
            (dict(tool_choice="sometimes"), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model="demo", messages=MSGS, tools=TOOLS, max_tokens=5,
                                      **kw)
        assert ei.value.body["param"] == param, (kw, ei.value.body)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model="demo", messages=MSGS, tool_choice="required",
                                  max_tokens=5)
    assert ei.value.body["param"] == "tool_choice"
