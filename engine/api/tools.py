"""Tool calling: the tool-call parsers (`--tool-call-parser`, vLLM's names) and the JSON
schemas that enforce `tool_choice: "required"` and a named function through structured
outputs. Pure Python: protocol.py and server.py call it.

- `hermes` (Hermes, Qwen 2.5 / 3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text before the first call is the message content.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole output is one JSON object `{"name": ...,
  "parameters": {...}}` (or several joined by `;`), optionally after `<|python_tag|>`;
  output that is not such JSON is plain content.
- `mistral` (Mistral, Mixtral, Ministral): after `[TOOL_CALLS]`, a JSON list of
  `{"name", "arguments"}` (older tokenizers) or `name[ARGS]{...}` per call (v11 and
  later); text before `[TOOL_CALLS]` is content.
- `pythonic` (Llama 3.2 / 4 with the pythonic template): the output is a Python list of
  calls with keyword arguments, `[get_weather(city="Paris"), now()]`, optionally inside
  `<|python_start|>` … `<|python_end|>`; the arguments must be literals.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  …</function></tool_call>`; a value is JSON where it parses as JSON and the tool's
  schema does not make it a string, else text; text before the first call is content.

A malformed call leaves the whole output as content (never a half-read call).
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
# parsers whose call marker is a special token in their models' tokenizers (mistral's
# [TOOL_CALLS]): with tool_choice auto the output keeps special tokens, as vLLM's parser
# asks (the others' markers are plain tokens, or optional to their parsers)
MARKED_BY_SPECIAL_TOKENS = ("mistral",)


@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it

    def to_openai(self, call_id: str | None = None) -> dict[str, Any]:
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "chatcmpl-tool-" + os.urandom(12).hex()


# what json raises on text it cannot read (nesting deeper than the stack included)
BAD_JSON = (ValueError, RecursionError)


def call_from_json(obj: Any, args_key: str) -> ToolCall | None:
    """The call a parsed `{"name": ..., args_key: ...}` object is, or None: not a call."""
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
            call = call_from_json(json.loads(m.group(1)), "arguments")
        except BAD_JSON:
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
        except BAD_JSON:
            return text, []
        call = call_from_json(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


MISTRAL_TOKEN = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(MISTRAL_TOKEN)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    body = text[start:]
    calls: list[ToolCall] = []
    dec = json.JSONDecoder()
    for part in body.split(MISTRAL_TOKEN)[1:]:
        part = part.strip()
        if part.startswith("["):       # [{"name": ..., "arguments": {...}}, ...]
            try:
                items, end = dec.raw_decode(part)
            except BAD_JSON:
                return text, []
            got = ([call_from_json(x, "arguments") for x in items]
                   if isinstance(items, list) else [None])
            if not got or None in got or part[end:].strip():
                return text, []
            calls += got
        elif _MISTRAL_ARGS in part:    # name[ARGS]{...}
            name, _, args = part.partition(_MISTRAL_ARGS)
            try:
                obj, end = dec.raw_decode(args.strip())
            except BAD_JSON:
                return text, []
            if not name.strip() or not isinstance(obj, dict) or args.strip()[end:].strip():
                return text, []
            calls.append(ToolCall(name.strip(), json.dumps(obj, ensure_ascii=False)))
        else:
            return text, []
    return (content, calls) if calls else (text, [])


def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_start|>"):
        body = body[len("<|python_start|>"):]
        body = body.removesuffix("<|python_end|>")
    body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return text, []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            arguments = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, MemoryError, RecursionError):
            return text, []   # not a literal, or one JSON cannot hold (a set, bytes)
        calls.append(ToolCall(node.func.id, arguments))
    return None, calls


_QWEN3_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>",
                         re.DOTALL)
_QWEN3_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None
                      ) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    end = start
    for m in _QWEN3_CALL.finditer(text, start):
        if text[end:m.start()].strip():
            return text, []          # text between calls: not a well-formed output
        name = m.group(1)
        args = {k: qwen3_value(v, param_type(tools, name, k))
                for k, v in _QWEN3_PARAM.findall(m.group(2))}
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        end = m.end()
    if not calls or text[end:].strip():
        return text, []
    return text[:start].strip() or None, calls


def param_type(tools: list[dict[str, Any]] | None, name: str, key: str) -> str | None:
    """The JSON schema type of tool `name`'s parameter `key` (None: unknown)."""
    for t in tools or ():
        fn = t.get("function") or {}
        if fn.get("name") == name:
            prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
            typ = prop.get("type")
            return typ if isinstance(typ, str) else None
    return None


def qwen3_value(text: str, typ: str | None) -> Any:
    if typ == "string":
        return text
    try:
        return json.loads(text)
    except BAD_JSON:
        return text


def parse_tool_calls(parser: str, text: str, tools: list[dict[str, Any]] | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content or None, the tool calls) of a whole output under `parser`."""
    if parser == "qwen3_coder":
        return parse_qwen3_coder(text, tools)
    return {"hermes": parse_hermes, "llama3_json": parse_llama3_json,
            "mistral": parse_mistral, "pythonic": parse_pythonic}[parser](text)


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
    except BAD_JSON:
        return []
    return [c for c in (call_from_json(x, "parameters") for x in items) if c is not None]


def outcome(choice: str, name: str | None, parser: str | None, text: str,
            finish_reason: str | None, tools: list[dict[str, Any]] | None = None
            ) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a whole chat output under tool_choice
    `choice`. A cut output (finish "length") is content, with no calls."""
    if choice == "none" or finish_reason not in ("stop", None):
        return text, [], finish_reason
    if choice == "named":
        return None, [ToolCall(name or "", text)], finish_reason   # OpenAI: "stop"
    if choice == "required":
        content, calls = None, calls_from_required(text)
    else:
        content, calls = parse_tool_calls(parser or "hermes", text, tools)
    if not calls:
        return text, [], finish_reason
    return content, calls, "tool_calls"
