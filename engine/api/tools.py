"""Tool calling: the tool-call parsers (`--tool-call-parser`, vLLM's names) and the JSON
schemas that enforce `tool_choice: "required"` and a named function through structured
outputs. Pure Python: protocol.py and server.py call it.

- `hermes` (Hermes, Qwen 2.5 / 3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text before the first call is the message content.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole output is one JSON object `{"name": ...,
  "parameters": {...}}` (or several joined by `;`), optionally after `<|python_tag|>`;
  output that is not such JSON is plain content.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it

    def to_openai(self, call_id: str | None = None) -> dict[str, Any]:
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "chatcmpl-tool-" + os.urandom(12).hex()


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):     # already JSON text
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:          # a malformed call: the whole output stays content
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{"):
        return text, []
    calls = []
    dec = json.JSONDecoder()
    i = 0
    while i < len(body):
        try:
            obj, end = dec.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, the tool calls) of a whole output under `parser`."""
    return (parse_hermes if parser == "hermes" else parse_llama3_json)(text)


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (any object when it has none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more {name, parameters} calls (vLLM's
    encoding), each parameters object following its tool's schema."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
         "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": parameters(t)}}
        for t in tools]}}


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of an output made under required_schema (a cut output: none)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [c for c in (_call(x, "parameters") for x in items) if c is not None]


def outcome(choice: str, name: str | None, parser: str | None, text: str,
            finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a whole chat output under tool_choice
    `choice`. A cut output (finish "length") is content, with no calls."""
    if choice == "none" or finish_reason not in ("stop", None):
        return text, [], finish_reason
    if choice == "named":
        return None, [ToolCall(name or "", text)], finish_reason   # OpenAI: "stop"
    calls = calls_from_required(text) if choice == "required" else \
        parse_tool_calls(parser or "hermes", text)[1]
    if not calls:
        return text, [], finish_reason
    content = None if choice == "required" else parse_tool_calls(parser or "hermes", text)[0]
    return content, calls, "tool_calls"
