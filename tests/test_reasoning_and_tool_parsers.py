"""--reasoning-parser and the tool parsers as a client sees them: the `openai` client on
loopback against a server whose engine writes a script (several characters a step), so
the split of reasoning, content and tool calls is checked on known text, whole and
streamed, and the tool-call arguments are seen arriving in pieces."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")

from test_server_fake import FakeEngine, FakeTokenizer
from zerod.engine.reasoning import split_reasoning
from zerod.engine.api.server import ServerThread
from zerod.engine.api.tools import parse_tool_calls
from zerod.engine.core.request import RequestOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOW]
HERMES = ('<think>The user wants weather.</think>\n\nLet me check. <tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
          '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
QWEN3_CODER = ('<think>hm</think>\n\nSure. <tool_call>\n<function=get_weather>\n'
               '<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n'
               '</function>\n</tool_call>')
MSGS = [{"role": "user", "content": "weather?"}]


class ScriptedEngine(FakeEngine):
    """Writes `script` to every request, `step` characters per tick, then stops."""

    script = ""
    step = 3

    def _poller(self):
        while not self.stop.is_set():
            time.sleep(self.tick)
            outs = []
            with self.lock:
                for rid, r in list(self.reqs.items()):
                    i = r["n"] * self.step
                    r["n"] += 1
                    text = self.script[i:i + self.step]
                    fin = i + self.step >= len(self.script)
                    if fin:
                        del self.reqs[rid]
                    outs.append((r["cb"], RequestOutput(rid, [5], text, fin,
                                                        "stop" if fin else None, r["plen"],
                                                        r["n"])))
            for cb, o in outs:
                cb(o)


class TextTokenizer(FakeTokenizer):
    """Decodes what it encodes (the server reads the prompt's end as text)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 2) for i in ids if i >= 2)


@pytest.fixture
def server():
    made = []

    def start(script, tokenizer=None, **kw):
        eng = ScriptedEngine(tick=0.001)
        eng.script = script
        if tokenizer is not None:
            eng.tokenizer = tokenizer
        srv = ServerThread(eng, **kw).start()
        made.append((eng, srv))
        return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    yield start
    for eng, srv in made:
        srv.stop()
        eng.shutdown()


def _stream(client, **kw):
    """The deltas of a stream, in order: (kind, index, payload)."""
    seen = []
    for chunk in client.chat.completions.create(model="fake", messages=MSGS, stream=True,
                                                max_tokens=200, **kw):
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                seen.append(("reasoning", ch.index, extra["reasoning_content"]))
            if d.content:
                seen.append(("content", ch.index, d.content))
            for tc in d.tool_calls or []:
                seen.append(("call", tc.index, tc))
            if ch.finish_reason:
                seen.append(("finish", ch.index, ch.finish_reason))
    return seen


def _joined(seen, kind):
    return "".join(p for k, _, p in seen if k == kind)


def _calls(seen):
    calls = {}
    for k, _, tc in seen:
        if k == "call":
            c = calls.setdefault(tc.index, {"name": "", "args": "", "pieces": 0, "id": None})
            c["id"] = c["id"] or tc.id
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["args"] += (tc.function.arguments or "") if tc.function else ""
            c["pieces"] += 1
    return calls


def test_reasoning_and_hermes_calls_whole(server):
    c = server(HERMES, tool_parser="hermes", reasoning_parser="deepseek_r1")
    r = c.chat.completions.create(model="fake", messages=MSGS, tools=TOOLS, max_tokens=200)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants weather."
    assert m.model_extra["reasoning"] == "The user wants weather."
    assert m.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert r.choices[0].finish_reason == "tool_calls"


def test_reasoning_and_hermes_calls_streamed_as_generated(server):
    c = server(HERMES, tool_parser="hermes", reasoning_parser="deepseek_r1")
    seen = _stream(c, tools=TOOLS)
    kinds = [k for k, _, _ in seen]
    # reasoning first, then content, then the calls, then the finish reason
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "content")
    assert _joined(seen, "reasoning") == "The user wants weather."
    assert _joined(seen, "content").strip() == "Let me check."
    calls = _calls(seen)
    assert [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    assert calls[0]["pieces"] > 3  # the arguments came in pieces, while generated
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["id"] != calls[1]["id"]
    assert seen[-1] == ("finish", 0, "tool_calls")


def test_qwen3_reasoning_with_qwen3_coder_calls_streamed(server):
    c = server(QWEN3_CODER, tool_parser="qwen3_coder", reasoning_parser="qwen3")
    seen = _stream(c, tools=TOOLS)
    assert _joined(seen, "reasoning") == "hm" and _joined(seen, "content").strip() == "Sure."
    calls = _calls(seen)
    assert calls[0]["name"] == "get_weather"
    # the schema makes days an integer and city a string
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": 3}
    assert calls[0]["pieces"] >= 3   # the name, then a piece per parameter, then the close
    whole = c.chat.completions.create(model="fake", messages=MSGS, tools=TOOLS, max_tokens=200)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == \
        {"city": "Paris", "days": 3}


def test_qwen3_without_thinking_is_all_content(server):
    c = server("No thinking here.", reasoning_parser="qwen3")
    r = c.chat.completions.create(model="fake", messages=MSGS, max_tokens=200)
    assert r.choices[0].message.content == "No thinking here."
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    seen = _stream(c)
    assert _joined(seen, "content") == "No thinking here." and not _joined(seen, "reasoning")


def test_an_output_cut_while_thinking_has_no_content(server):
    c = server("<think>still going", reasoning_parser="deepseek_r1")
    m = c.chat.completions.create(model="fake", messages=MSGS, max_tokens=200).choices[0].message
    assert m.content is None and m.model_extra["reasoning_content"] == "still going"


def test_streamed_logprobs_with_a_reasoning_parser_are_refused_by_name(server):
    c = server("<think>a</think>b", reasoning_parser="deepseek_r1")
    with pytest.raises(openai.BadRequestError) as e:
        list(c.chat.completions.create(model="fake", messages=MSGS, max_tokens=20,
                                       stream=True, logprobs=True))
    assert e.value.body["param"] == "logprobs" and e.value.body["code"] == "unsupported"
    # not streamed, they are served
    r = c.chat.completions.create(model="fake", messages=MSGS, max_tokens=20, logprobs=True)
    assert r.choices[0].message.content == "b"


def test_a_prompt_that_closed_the_thinking_makes_the_output_all_content(server):
    """deepseek_r1 reads an output without `</think>` as reasoning, unless the chat
    template already closed the thinking in the prompt (as with enable_thinking: false)."""
    c = server("just the answer", reasoning_parser="deepseek_r1", tokenizer=TextTokenizer())
    # the prompt ends with a closed thinking (the fake template has no enable_thinking)
    closed = [*MSGS, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    m = c.chat.completions.create(model="fake", messages=closed, max_tokens=200,
                                  extra_body=cont).choices[0].message
    assert m.content == "just the answer" and m.model_extra["reasoning_content"] is None
    seen = []
    for chunk in c.chat.completions.create(model="fake", messages=closed, max_tokens=200,
                                           stream=True, extra_body=cont):
        for ch in chunk.choices:
            seen.append((ch.delta.content, (ch.delta.model_extra or {}).get("reasoning_content")))
    assert "".join(t or "" for t, _ in seen) == "just the answer"
    assert not any(r for _, r in seen)
    m = c.chat.completions.create(model="fake", messages=MSGS, max_tokens=200).choices[0].message
    assert m.content is None and m.model_extra["reasoning_content"] == "just the answer"


def test_without_reasoning_parser_the_think_text_stays_content(server):
    c = server("<think>x</think>y")
    r = c.chat.completions.create(model="fake", messages=MSGS, max_tokens=200)
    assert r.choices[0].message.content == "<think>x</think>y"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


@pytest.mark.parametrize("parser,text,content,calls", [
    ("mistral", 'Sure [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Sure", [("now", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', None,
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{broken", "[TOOL_CALLS]get_weather[ARGS]{broken", []),
    ("pythonic", '[get_weather(city="Paris", days=3), now()]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ("pythonic", '<|python_start|>[now()]<|python_end|>', None, [("now", {})]),
    ("pythonic", '[os.system("rm -rf /")]', '[os.system("rm -rf /")]', []),
    ("pythonic", "[now(x=open('f'))]", "[now(x=open('f'))]", []),
    ("qwen3_coder", "<tool_call><function=now></function></tool_call>", None, [("now", {})]),
    ("qwen3_coder", "<tool_call><function=now>", "<tool_call><function=now>", []),
])
def test_tool_parsers_on_whole_outputs(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek_r1", "a</think>b", "a", "b"),
    ("deepseek_r1", "<think>a</think>\n\nb", "a", "b"),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>a</think>b", "a", "b"),
    ("qwen3", "a</think>b", None, "a</think>b"),
])
def test_reasoning_split(parser, text, reasoning, content):
    s = split_reasoning(parser, text)
    assert (s.reasoning, s.content) == (reasoning, content)
