"""One streamed chat choice turned into OpenAI's deltas while it is generated: its
reasoning (`--reasoning-parser`) as `reasoning_content` / `reasoning` deltas, then its
answer as `content` deltas or tool calls (`tool_calls[i]`: id, type and name once, then
`function.arguments` pieces).

What streams when:
- a named function: its arguments as they come (the output is the arguments);
- `auto` with `hermes`: content up to `<tool_call>`, then each call's name as soon as it
  is read and its arguments as they are written;
- `auto` with `qwen3_coder`: content up to `<tool_call>`, then the call's name, then its
  arguments one parameter at a time as each closes;
- `auto` with `llama3_json`, `mistral` (tool_streams.py) or `pythonic`
  (pythonic_stream.py): content while the output cannot be a call (mistral: up to `[TOOL_CALLS]`), then each call's name once its
  opening is read and its arguments as they are written (pythonic: a keyword argument at
  a time as each value closes);
- `required`: the calls once the output is whole.
At the end the whole answer is parsed as a non-streamed one is (tools.outcome), which
settles the finish reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..reasoning import ReasoningStream, partial_tail
from .pythonic_stream import PythonicCalls
from .tool_streams import Llama3JsonCalls, MistralCalls
from .tools import new_call_id, outcome, param_type, parse_hermes, qwen3_value

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_QWEN3_FUNCTION = re.compile(r"<function=([^>\s]+)>")
_QWEN3_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ChoiceStream:
    def __init__(self, tool_choice: str, tool_name: str | None, parser: str | None,
                 tools: list[dict[str, Any]] | None, reasoning: str | None,
                 thinking_closed: bool = False) -> None:
        self.choice, self.name, self.parser, self.tools = tool_choice, tool_name, parser, tools
        self.reasoning = ReasoningStream(reasoning, thinking_closed) if reasoning else None
        self.answer: list[str] = []   # the whole answer, for the final parse
        self.calls = 0                # tool calls sent
        incremental = {"hermes": _HermesCalls, "qwen3_coder": _Qwen3CoderCalls,
                       "llama3_json": Llama3JsonCalls, "mistral": MistralCalls,
                       "pythonic": PythonicCalls}
        self.calls_stream = (incremental[parser](tools) if tool_choice == "auto"
                             and parser in incremental else None)
        self.named_started = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send for this piece of output."""
        out: list[dict[str, Any]] = []
        answer = text
        if self.reasoning is not None:
            thought, answer = self.reasoning.feed(text)
            if thought:
                out.append({"reasoning_content": thought, "reasoning": thought})
        if answer:
            out += self._answer(answer)
        return out

    def end(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason, once the output is whole."""
        out: list[dict[str, Any]] = []
        if self.reasoning is not None:
            thought, answer = self.reasoning.end()
            if thought:
                out.append({"reasoning_content": thought, "reasoning": thought})
            if answer:
                out += self._answer(answer)
        text = "".join(self.answer)
        if self.choice == "none" or (self.reasoning is not None and not text):
            return out, finish_reason   # no answer (all reasoning): no call either
        if self.choice == "named":
            if not self.named_started:
                out += self._named_head()
            return out, finish_reason
        if self.calls_stream is not None:
            out += self.calls_stream.end(self)
            return out, "tool_calls" if self.calls and finish_reason == "stop" else finish_reason
        content, calls, finish = outcome(self.choice, None, self.parser, text, finish_reason,
                                         self.tools)
        if content:
            out.append({"content": content})
        for call in calls:
            out.append(self.call_delta(call.name, call.arguments))
        return out, finish

    # ------------------------------------------------------------------ the answer

    def _answer(self, text: str) -> list[dict[str, Any]]:
        self.answer.append(text)
        if self.choice == "none":
            return [{"content": text}]
        if self.choice == "named":
            head = [] if self.named_started else self._named_head()
            return head + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self.calls_stream is not None:
            return self.calls_stream.feed(self, text)
        return []   # parsed at the end

    def _named_head(self) -> list[dict[str, Any]]:
        self.named_started = True
        self.calls = 1
        return [{"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                 "function": {"name": self.name, "arguments": ""}}]}]

    def call_delta(self, name: str, arguments: str) -> dict[str, Any]:
        """A new call's first delta (its name, and its arguments so far)."""
        d = {"tool_calls": [{"index": self.calls, "id": new_call_id(), "type": "function",
                             "function": {"name": name, "arguments": arguments}}]}
        self.calls += 1
        return d

    def args_delta(self, arguments: str) -> dict[str, Any]:
        """More arguments of the call sent last."""
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": arguments}}]}


def _to_open_tag(calls, out: list[dict[str, Any]]) -> bool:
    """Before a call: content up to `<tool_call>` (none after the first call: text between
    and after calls is not content, as the whole-output parsers read it), holding back what
    may be the tag's start and the whitespace before it (the parsers strip the content
    before a call). True once the tag is consumed."""
    i = calls.buf.find(_HERMES_OPEN)
    cut = i if i >= 0 else len(calls.buf) - partial_tail(calls.buf, _HERMES_OPEN)
    if calls.state == "content":
        shown = len(calls.buf[:cut].rstrip())
        if shown:
            out.append({"content": calls.buf[:shown]})
            calls.shown += shown
        if i < 0:
            cut = shown
    calls.buf = calls.buf[i + len(_HERMES_OPEN):] if i >= 0 else calls.buf[cut:]
    return i >= 0


def _no_call_after_all(calls, cs: ChoiceStream) -> list[dict[str, Any]]:
    """The output ended past `<tool_call>` with no call sent: it is content, as the
    whole-output parsers read it; the content before the tag is sent already."""
    if cs.calls or calls.state == "content":
        return []
    rest = "".join(cs.answer)[calls.shown:]
    return [{"content": rest}] if rest else []


def _name_first(buf: str) -> bool:
    """The call's JSON opens with its name (so its head is still coming)."""
    compact = "".join(buf.split())
    return compact.startswith('{"name"') or '{"name"'.startswith(compact)


def _args_end(body: str) -> int:
    """Where a hermes call's arguments may end so far: before the trailing `}` (it may be
    the one that closes the call) and the whitespace after it."""
    stripped = body.rstrip()
    return len(stripped) - 1 if stripped.endswith("}") else len(stripped)


class _HermesCalls:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, read as it comes."""

    def __init__(self, tools) -> None:
        self.buf = ""
        self.state = "content"  # content | head | args | whole | after
        self.sent = 0           # characters of this call's arguments sent
        self.shown = 0          # characters of the output sent as content

    def feed(self, cs: ChoiceStream, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self.state in ("content", "after"):
                if not _to_open_tag(self, out):
                    return out
                self.state, self.sent = "head", 0
            if self.state == "head":
                m = _HERMES_HEAD.match(self.buf)
                if m is None:
                    name_first = _name_first(self.buf)
                    if _HERMES_CLOSE in self.buf or (not name_first and '"arguments"' in self.buf):
                        self.state = "whole"   # name after the arguments: read it whole
                        continue
                    return out
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    self.state = "whole"
                    continue
                rest = self.buf[m.end():]
                if not rest.strip():
                    return out       # the arguments' first character decides how they stream
                if not rest.lstrip().startswith("{"):
                    self.state = "whole"   # arguments as a JSON string: sent decoded, whole
                    continue
                out.append(cs.call_delta(name, ""))
                self.buf, self.state = rest.lstrip(), "args"
            if self.state == "args":
                j = self.buf.find(_HERMES_CLOSE)
                body = self.buf[:j] if j >= 0 else \
                    self.buf[:len(self.buf) - partial_tail(self.buf, _HERMES_CLOSE)]
                upto = _args_end(body)
                if upto > self.sent:
                    out.append(cs.args_delta(body[self.sent:upto]))
                    self.sent = upto
                if j < 0:
                    return out
                self.buf, self.state = self.buf[j + len(_HERMES_CLOSE):], "after"
                continue
            if self.state == "whole":
                j = self.buf.find(_HERMES_CLOSE)
                if j < 0:
                    return out
                out += self._whole(cs, self.buf[:j])
                self.buf, self.state = self.buf[j + len(_HERMES_CLOSE):], "after"

    def _whole(self, cs: ChoiceStream, body: str) -> list[dict[str, Any]]:
        _, calls = parse_hermes(_HERMES_OPEN + body + _HERMES_CLOSE)
        return [cs.call_delta(c.name, c.arguments) for c in calls]

    def end(self, cs: ChoiceStream) -> list[dict[str, Any]]:
        """The output ended: a call without its closing tag ends here (as parse_hermes
        reads it); held content is sent."""
        out: list[dict[str, Any]] = []
        if self.state == "content" and self.buf:
            out.append({"content": self.buf})
        elif self.state == "args":
            body = self.buf
            upto = _args_end(body)
            if upto > self.sent:
                out.append(cs.args_delta(body[self.sent:upto]))
        elif self.state in ("head", "whole") and self.buf.strip():
            out += self._whole(cs, self.buf)
        out += _no_call_after_all(self, cs)
        self.buf = ""
        return out


class _Qwen3CoderCalls:
    """`<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>`:
    the name once read, then the arguments a parameter at a time."""

    def __init__(self, tools) -> None:
        self.tools = tools
        self.buf = ""
        self.state = "content"   # content | function | params | after
        self.function = ""
        self.params = 0
        self.shown = 0   # characters of the output sent as content

    def feed(self, cs: ChoiceStream, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self.state in ("content", "after"):
                if not _to_open_tag(self, out):
                    return out
                self.state = "function"
            if self.state == "function":
                m = _QWEN3_FUNCTION.search(self.buf)
                if m is None:
                    return out
                self.function, self.params = m.group(1), 0
                out.append(cs.call_delta(self.function, ""))
                self.buf, self.state = self.buf[m.end():], "params"
            if self.state == "params":
                m = _QWEN3_PARAM.search(self.buf)
                close = self.buf.find("</function>")
                if m is not None and (close < 0 or m.start() < close):
                    key, raw = m.group(1), m.group(2)
                    value = qwen3_value(raw, param_type(self.tools, self.function, key))
                    piece = (", " if self.params else "{") + json.dumps(key) + ": " + \
                        json.dumps(value, ensure_ascii=False)
                    self.params += 1
                    out.append(cs.args_delta(piece))
                    self.buf = self.buf[m.end():]
                    continue
                if close < 0:
                    return out
                out.append(cs.args_delta("}" if self.params else "{}"))
                self.buf, self.state = self.buf[close + len("</function>"):], "after"
                j = self.buf.find("</tool_call>")
                if j >= 0:
                    self.buf = self.buf[j + len("</tool_call>"):]

    def end(self, cs: ChoiceStream) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.state == "content" and self.buf:
            out.append({"content": self.buf})
        elif self.state == "params":
            out.append(cs.args_delta("}" if self.params else "{}"))
        out += _no_call_after_all(self, cs)
        self.buf = ""
        return out

