"""Streamed tool calls of the llama3_json, mistral and pythonic parsers (engine/api/
tool_streams.py through chat_stream.ChoiceStream): each output is fed whole, a character
at a time and at random cuts, and what the deltas add up to (content, each call's name
and arguments, the finish reason) must be what the whole-output parse makes of it; the
arguments must come in pieces while generated."""

from __future__ import annotations

import json
import random

import pytest

from zerod.engine.api.chat_stream import ChoiceStream
from zerod.engine.api.tools import outcome

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOW]

LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "get_weather", '
    '"parameters": {"city": "Oslo \\"north\\" {x}", "days": [1, {"a": "]"}]}}',
    ' \n{"name":"now","arguments":{}}\n',
    '\u00a0{"name": "now", "parameters": {}}',
    '{"parameters": {"city": "Rome"}, "name": "get_weather"}',   # name after arguments
    '{"name": "get_weather", "parameters": "{\\"city\\": \\"Rome\\"}"}',  # arguments as text
    '{"name": "now"}',
    '{"name": "caf\\u00e9", "parameters": {"q": "caf\\u00e9 \u00e9"}}',
    # not calls: content, whole
    'The weather is fine.',
    '{"answer": 42}',
    '{"broken": ',
    '<|python_tag|>print(1)',
    '  ',
    '<|python_ta',
    '[1, 2]',
]
MISTRAL = [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    'Sure, one moment. [TOOL_CALLS] [{"name": "now", "arguments": {}}, '
    '{"name": "get_weather", "arguments": {"city": "[TOOL]", "days": 1}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}',
    'Text\n\n[TOOL_CALLS]get_weather[ARGS] {"city": "Lyon"} ',
    '[TOOL_CALLS][{"arguments": {"city": "Rome"}, "name": "get_weather"}]',
    # not calls: content, whole
    'Plain [TOOL text with a bracket',
    'Plain text [TOOL_CALLS] that is not a call',
    '[TOOL_CALLS][]',
    '[TOOL_CALLS][{"no": "name"}]',
    '[TOOL_CALLS]get_weather[ARGS]"text"',
    '[TOOL_CALLS]get_weather',
    '[TOOL_CALLS]  [ARGS]{}',
    'trailing space   ',
]
PYTHONIC = [
    '[get_weather(city="Paris", days=3), now()]',
    '<|python_start|>[now()]<|python_end|>',
    '[get_weather(city=\'it\\\'s, "quoted" (x)\', days=-2, extra=[1, (2, 3)], '
    'm={"k": None, "t": True}, s="""tri"ple""", e="", r=r"\\d"),]',
    '[get_weather(\n  city = "Rome" ,  # the city\n  days=1\n)]',
    '[get_weather(city="caf\u00e9", days=1.5e3)]',
    '[now(**{"a": 1}), now(b=2)]',
    '[ifnow(Nonex=1)]',
    '[now(\\\n  a=1,\n)]',
    # not calls: content, whole
    '[os.system("rm -rf /")]',
    "[now(x=open('f'))]",
    '[now(1)]',
    '[now(a={1, 2})]',
    '[Paris, London]',
    '[click here](https://example.com)',
    'just text',
    '[]',
    '[now(a==1)]',
    '<|python_start|>',
    '[if(a=1)]',
    '[now(None=1)]',
    '[now(**)]',
    '[see(below)]',
]
CASES = [("llama3_json", t) for t in LLAMA3] + [("mistral", t) for t in MISTRAL] + \
    [("pythonic", t) for t in PYTHONIC]


def _run(parser: str, pieces: list[str]) -> dict:
    """Feed the pieces as a streamed choice does; the deltas added up."""
    cs = ChoiceStream("auto", None, parser, TOOLS, None)
    deltas = []
    for p in pieces:
        deltas += [(d, False) for d in cs.feed(p)]
    last, finish = cs.end("stop")
    deltas += [(d, True) for d in last]
    content, calls = "", {}
    for d, final in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            fn = tc["function"]
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["id"].startswith("chatcmpl-tool-")
                calls[tc["index"]] = {"name": fn["name"], "args": fn["arguments"],
                                      "streamed": 0}
            else:
                assert set(fn) == {"arguments"} and tc["index"] == len(calls) - 1
                c = calls[tc["index"]]
                c["args"] += fn["arguments"]
                c["streamed"] += not final
    return {"content": content or None, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


def _expected(parser: str, text: str):
    content, calls, finish = outcome("auto", None, parser, text, "stop", TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], finish


def _check(parser: str, text: str, pieces: list[str]) -> dict:
    got = _run(parser, pieces)
    content, calls, finish = _expected(parser, text)
    assert [(c["name"], json.loads(c["args"])) for c in got["calls"]] == calls
    assert got["content"] == content
    assert got["finish"] == finish
    return got


def _cuts(text: str, rng: random.Random) -> list[str]:
    at = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
    return [text[i:j] for i, j in zip([0] + at, at + [len(text)])]


@pytest.mark.parametrize("parser,text", CASES)
def test_streamed_calls_add_up_to_the_whole_output_parse(parser, text):
    _check(parser, text, [text])
    _check(parser, text, list(text))
    rng = random.Random(text)
    for _ in range(30):
        _check(parser, text, _cuts(text, rng))


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", LLAMA3[0]), ("mistral", MISTRAL[0]), ("mistral", MISTRAL[2]),
    ("pythonic", PYTHONIC[0])])
def test_arguments_stream_while_generated(parser, text):
    got = _check(parser, text, list(text))
    assert got["calls"][0]["name"] == "get_weather"
    assert got["calls"][0]["streamed"] >= 2


def test_pythonic_arguments_come_a_keyword_at_a_time_as_json():
    cs = ChoiceStream("auto", None, "pythonic", TOOLS, None)
    sent = []
    for ch in '[get_weather(city="Paris", days=3)]':
        for d in cs.feed(ch):
            sent += [tc["function"]["arguments"] for tc in d["tool_calls"]]
    assert sent == ["", '{"city": "Paris"', ', "days": 3', "}"]
    assert "".join(sent) == json.dumps({"city": "Paris", "days": 3})


def test_a_value_is_held_until_it_closes():
    cs = ChoiceStream("auto", None, "pythonic", TOOLS, None)
    assert cs.feed('[get_weather(city="a, b)') == []
    assert cs.feed('"') == []
    head, first, close = cs.feed(")]")
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "a, b)"'}}]}
    assert close == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}


def test_mistral_content_streams_before_the_calls():
    cs = ChoiceStream("auto", None, "mistral", TOOLS, None)
    assert cs.feed("Let me check ") == [{"content": "Let me check"}]
    assert cs.feed("[TOOL_") == []      # may be the token's start
    assert cs.feed("CALLS]") == []
    got = cs.feed('now[ARGS]{')
    assert got[0]["tool_calls"][0]["function"]["name"] == "now"


def test_plain_text_streams_as_content_at_once():
    for parser in ("llama3_json", "pythonic"):
        cs = ChoiceStream("auto", None, parser, TOOLS, None)
        assert cs.feed("Hello") == [{"content": "Hello"}]
        assert cs.feed(" there") == [{"content": " there"}]
        assert cs.end("stop") == ([], "stop")


def test_an_output_cut_by_length_keeps_the_finish_reason():
    cs = ChoiceStream("auto", None, "llama3_json", TOOLS, None)
    cs.feed('{"name": "get_weather", "parameters": {"city": "Pa')
    _, finish = cs.end("length")
    assert finish == "length"


def test_malformed_after_a_committed_call_drops_the_rest():
    # not streamed this is content; streamed, the name is out and cannot be taken back
    got = _run("pythonic", list('[get_weather(city="Oslo", city=open("f"))]'))
    assert [c["name"] for c in got["calls"]] == ["get_weather"] and got["content"] is None


def _pairs(calls) -> list:
    out = []
    for name, args in calls:
        try:
            out.append((name, json.loads(args)))
        except ValueError:
            out.append((name, "not JSON: " + args))
    return out


# mangled Python text holds escapes Python warns about as it parses them
@pytest.mark.filterwarnings("ignore:invalid escape sequence")
@pytest.mark.parametrize("parser,base", [("llama3_json", LLAMA3), ("mistral", MISTRAL),
                                         ("pythonic", PYTHONIC)])
def test_mangled_outputs_stream_as_they_parse(parser, base):
    """Outputs with characters dropped, added and cut off: where the whole-output parser
    finds calls, the stream sends them; where it finds none, the stream is that content
    unless a call was sent before the output broke; and the split never matters."""
    rng = random.Random(parser)
    alphabet = list('{}[]",:;() =\\\'#\nab1') + ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
                                                  "<|python_end|>"]
    for _ in range(400):
        text = rng.choice(base)
        for _ in range(rng.randint(1, 3)):
            k, op = rng.randrange(len(text) + 1), rng.random()
            text = (text[:k] + rng.choice(alphabet) + text[k:] if op < 0.4 else
                    text[:k] + text[k + 1:] if op < 0.8 else text[:k])
        if len(text) < 2:
            continue
        got, whole = _run(parser, _cuts(text, rng)), _run(parser, [text])
        assert (got["content"], _pairs((c["name"], c["args"]) for c in got["calls"])) == \
            (whole["content"], _pairs((c["name"], c["args"]) for c in whole["calls"])), text
        content, calls, _ = outcome("auto", None, parser, text, "stop", TOOLS)
        if calls:
            sent = _pairs((c["name"], c["args"]) for c in got["calls"])
            assert sent == _pairs((c.name, c.arguments) for c in calls), text
            # the one difference: whitespace before the content (stripped before a call)
            assert (got["content"] or "").lstrip() == (content or ""), text
        elif not got["calls"]:
            assert got["content"] == content, text


# ---------------------------------------------------------------- end to end, `openai` client

E2E = {
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "now", "parameters": {}}'),
    "mistral": ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "now", "arguments": {}}]'),
    "pythonic": '[get_weather(city="Paris", days=3), now()]',
}


@pytest.fixture
def scripted():
    openai = pytest.importorskip("openai")
    from test_reasoning_and_tool_parsers import ScriptedEngine
    from zerod.engine.api.server import ServerThread
    made = []

    def start(script, parser):
        eng = ScriptedEngine(tick=0.001)
        eng.script = script
        srv = ServerThread(eng, tool_parser=parser).start()
        made.append((eng, srv))
        return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    start.engines = lambda: [eng for eng, _ in made]   # what each engine was asked for
    yield start
    for eng, srv in made:
        srv.stop()
        eng.shutdown()


@pytest.mark.parametrize("parser", sorted(E2E))
def test_openai_client_gets_the_calls_streamed(scripted, parser):
    client = scripted(E2E[parser], parser)
    msgs = [{"role": "user", "content": "weather?"}]
    whole = client.chat.completions.create(model="fake", messages=msgs, tools=TOOLS,
                                           max_tokens=200).choices[0]
    content, calls, finish = "", {}, []
    for chunk in client.chat.completions.create(model="fake", messages=msgs, tools=TOOLS,
                                                max_tokens=200, stream=True):
        for ch in chunk.choices:
            if ch.finish_reason:
                finish.append(ch.finish_reason)
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                assert not finish    # every call delta comes before the finish chunk
                if tc.id:
                    assert tc.index == len(calls) and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                       "args": tc.function.arguments or "", "pieces": 0}
                else:
                    assert tc.function.name is None
                    calls[tc.index]["args"] += tc.function.arguments
                    calls[tc.index]["pieces"] += 1
    assert finish == ["tool_calls"] == [whole.finish_reason]
    assert (content or None) == whole.message.content
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert calls[0]["name"] == "get_weather" and calls[0]["pieces"] >= 2
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": 3}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("parser", sorted(E2E))
def test_openai_client_gets_plain_text_as_content(scripted, parser):
    client = scripted("No tool needed: [it is sunny] (20 C).", parser)
    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
        max_tokens=200, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "No tool needed: [it is sunny] (20 C)."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Let me check. \n<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    ("hermes", "Plain text, trailing space  \n"),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=now>\n</function>\n</tool_call>"),
    ("qwen3_coder", "Sure. <tool_"),
    ("hermes", 'Let me check. <tool_call>{"nme": "now"}</tool_call> and more'),
    ("hermes", "Let me check. <tool_call>not json"),
    ("qwen3_coder", "Sure. <tool_call> not a function"),
])
def test_hermes_and_qwen3_content_adds_up_as_the_whole_output_parse(parser, text):
    """Content up to a call, whitespace before it held back; an output with no call after
    `<tool_call>` after all is content to its end."""
    for pieces in ([text], list(text)):
        _check(parser, text, pieces)


@pytest.mark.parametrize("parser,choice,skips", [
    ("mistral", "auto", False), ("mistral", "none", True), ("hermes", "auto", True),
    ("pythonic", "auto", True)])
def test_mistral_output_keeps_its_tool_calls_token(scripted, parser, choice, skips):
    """[TOOL_CALLS] is a special token of Mistral's tokenizers: decoded without special
    tokens the output would hold no call."""
    client = scripted("ok", parser)
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                   tools=TOOLS, tool_choice=choice, max_tokens=20)
    params = scripted.engines()[-1].submitted[-1][2]
    assert params.skip_special_tokens is skips


def test_an_explicit_skip_special_tokens_the_mistral_parser_cannot_honour_is_refused(scripted):
    client = scripted("ok", "mistral")
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                       tools=TOOLS, max_tokens=20, extra_body={"skip_special_tokens": True})
    assert e.value.body["param"] == "skip_special_tokens" and "mistral" in e.value.body["message"]
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                   tools=TOOLS, tool_choice="none", max_tokens=20,
                                   extra_body={"skip_special_tokens": True})   # no parser reads it

