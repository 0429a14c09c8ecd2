"""The tool-call parsers (hermes, llama3_json) and what a whole output becomes under each
tool_choice: the tool calls in OpenAI's shape, content, finish_reason."""

from __future__ import annotations

import json

import jsonschema
import pytest
from zerod.engine.api.tools import ToolCall, outcome, parse_hermes, parse_llama3_json, required_schema

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}


def test_hermes_calls_and_content_before_them():
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert calls == [ToolCall("weather", '{"city": "Oslo"}'), ToolCall("time", "{}")]


@pytest.mark.parametrize("text", ["plain words", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_without_a_wellformed_call_is_content(text):
    assert parse_hermes(text) == (text, [])


def test_hermes_call_cut_before_its_closing_tag_still_parses():
    assert parse_hermes('<tool_call>{"name": "time", "arguments": {}}')[1] == [
        ToolCall("time", "{}")]


def test_llama3_json_one_or_several_calls():
    assert parse_llama3_json('{"name": "weather", "parameters": {"city": "Rome"}}') == (
        None, [ToolCall("weather", '{"city": "Rome"}')])
    content, calls = parse_llama3_json(
        '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", '
        '"arguments": {"city": "Lima"}}')
    assert content is None and [c.name for c in calls] == ["time", "weather"]
    assert json.loads(calls[1].arguments) == {"city": "Lima"}


@pytest.mark.parametrize("text", ["Hello there", '{"city": "no name"}', '{"name": "x"} trailing'])
def test_llama3_json_other_output_is_content(text):
    assert parse_llama3_json(text) == (text, [])


def test_required_schema_accepts_calls_of_the_given_tools_only():
    schema = required_schema([WEATHER, TIME])
    jsonschema.validate([{"name": "weather", "parameters": {"city": "x"}},
                         {"name": "time", "parameters": {}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_outcome_per_tool_choice():
    req = '[{"name": "time", "parameters": {}}]'
    content, calls, fr = outcome("required", None, None, req, "stop")
    assert (content, [c.name for c in calls], fr) == (None, ["time"], "tool_calls")
    content, calls, fr = outcome("named", "weather", None, '{"city": "Oslo"}', "stop")
    assert (content, calls, fr) == (None, [ToolCall("weather", '{"city": "Oslo"}')], "stop")
    assert outcome("auto", None, "hermes", "just text", "stop") == ("just text", [], "stop")
    assert outcome("none", None, None, "<tool_call>", "stop") == ("<tool_call>", [], "stop")
    # a cut output is content: its calls cannot be trusted
    assert outcome("required", None, None, '[{"name": "ti', "length") == (
        '[{"name": "ti', [], "length")
    call = ToolCall("time", "{}").to_openai()
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "time", "arguments": "{}"}


def test_serve_auto_tool_choice_needs_a_parser():
    from click.testing import CliRunner
    from zerod.engine.api.tools import PARSERS
    from zerod.engine.cli import serve

    r = CliRunner().invoke(serve, ["--model", "demo", "--enable-auto-tool-choice"])
    assert r.exit_code == 2 and "--tool-call-parser" in r.output
    r = CliRunner().invoke(serve, ["--model", "demo", "--tool-call-parser", "granite"])
    assert r.exit_code == 2 and "--tool-call-parser granite: not served" in r.output
    assert "zerod takes: " + ", ".join(PARSERS) in r.output
