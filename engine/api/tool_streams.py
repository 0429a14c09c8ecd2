"""Streamed tool calls for the formats that say whether an output is a call only by how
it opens: `llama3_json` and `mistral` here, `pythonic` in pythonic_stream.py (the
whole-output parsers are tools.parse_llama3_json / parse_mistral / parse_pythonic). Each
reader takes the output as it comes and sends, through a chat_stream.ChoiceStream, what
the whole-output parser will make of it:

- content as soon as it cannot be the start of a call (mistral: up to `[TOOL_CALLS]`,
  holding back trailing whitespace, which the parser strips before a call);
- a call's id, type and name once its opening is read (pythonic: with its first
  argument, since `[word(` alone is not yet a call); the output is then committed to
  calls;
- its arguments as they are generated: the JSON formats send the model's own argument
  text as written, pythonic sends JSON built a keyword argument at a time as each value
  closes (`{"a": 1`, `, "b": "x"`, `}`: together `json.dumps` of the arguments).

An output that is not a call before anything is committed streams as content, so it ends
as the whole-output parse does. One found malformed after a call's name was sent cannot
be taken back: the rest is dropped (vLLM has the same limit); not streamed, it is
content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..reasoning import partial_tail
from .tools import BAD_JSON, MISTRAL_TOKEN, call_from_json, parse_llama3_json, parse_mistral

Deltas = list[dict[str, Any]]

_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_ARGS = "[ARGS]"
_NAME = r'"((?:[^"\\]|\\.)*)"'
_W = "[ \t\r\n]*"   # JSON's whitespace
_LLAMA3_HEAD = re.compile(r'\{' + _W + '"name"' + _W + ':' + _W + _NAME + _W + ',' + _W
                          + '"(?:parameters|arguments)"' + _W + ':')
_MISTRAL_HEAD = re.compile(r'\{' + _W + '"name"' + _W + ':' + _W + _NAME + _W + ',' + _W
                           + '"arguments"' + _W + ':')
_JSON_WS = " \t\r\n"
_JSON_STOP = re.compile(r'["{}\[\]]')
_JSON_STR_STOP = re.compile(r'["\\]')


def could_open(text: str, pos: int, tag: str) -> bool:
    """text[pos:] is a proper start of tag (more may complete it)."""
    rest = text[pos:]
    return len(rest) < len(tag) and tag.startswith(rest)


def _skip(text: str, pos: int, chars: str = _JSON_WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def skip_space(text: str, pos: int) -> int:
    """After any whitespace from pos (str.strip's, as the whole-output parsers strip)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class _JsonEnd:
    """Where a JSON value ends, found as its text comes (strings and nesting read, the
    rest left to json.loads)."""

    def __init__(self, pos: int, depth: int = 0) -> None:
        self.pos, self.depth, self.in_str, self.esc = pos, depth, False, False

    def advance(self, text: str) -> int | None:
        """The index after the value's closing bracket, or None: not yet."""
        i, n = self.pos, len(text)
        while i < n:
            if self.in_str:
                if self.esc:
                    self.esc, i = False, i + 1
                    continue
                m = _JSON_STR_STOP.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.end()
                if m.group() == "\\":
                    self.esc = True
                else:
                    self.in_str = False
                continue
            m = _JSON_STOP.search(text, i)
            if m is None:
                i = n
                break
            i, c = m.end(), m.group()
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


class _JsonArgs:
    """A call's JSON arguments from text[start:] (their `{`), sent as they are written."""

    def __init__(self, start: int) -> None:
        self.scan, self.sent = _JsonEnd(start), start

    def step(self, text: str, cs, out: Deltas) -> int | None:
        """Sends what came; the index after the arguments once they close, else None."""
        close = self.scan.advance(text)
        upto = len(text) if close is None else close
        if upto > self.sent:
            out.append(cs.args_delta(text[self.sent:upto]))
            self.sent = upto
        return close


class Reader:
    """What the three readers share: the output so far, how much of it is sent as
    content, whether calls are committed, and the fall back to content."""

    parse: Any   # the format's whole-output parser

    def __init__(self, tools) -> None:
        self.text = ""
        self.pos = 0            # where reading has got to
        self.state = "lead"
        self.content_sent = 0   # text[:content_sent] is sent as content
        self.committed = False  # a call's name is sent
        self.call: _JsonCall | None = None   # the JSON call object being read (JSON formats)

    def feed(self, cs, text: str) -> Deltas:
        self.text += text
        out: Deltas = []
        if self.state == "content":
            return self._content_rest(out)
        if self.state != "dropped":
            self._step(cs, out)
        return out

    def _step(self, cs, out: Deltas) -> None:
        raise NotImplementedError

    def _content_rest(self, out: Deltas) -> Deltas:
        if len(self.text) > self.content_sent:
            out.append({"content": self.text[self.content_sent:]})
            self.content_sent = len(self.text)
        return out

    def _not_a_call(self, out: Deltas) -> None:
        """The output is found not to be well-formed calls."""
        if self.committed:
            self.state = "dropped"
        else:
            self.state = "content"
            self._content_rest(out)

    def _read_call(self, cs, out: Deltas) -> bool:
        """Reads on in the JSON call object begun (self.call); True once it closed, with
        pos past it. A malformed one falls back (_not_a_call)."""
        self.call.step(self, cs, out)
        if self.call.failed:
            self._not_a_call(out)
            return False
        if self.call.end is None:
            return False
        self.pos = self.call.end
        return True

    def commit(self, cs, name: str, arguments: str, out: Deltas) -> None:
        self.committed = True
        out.append(cs.call_delta(name, arguments))

    def end(self, cs) -> Deltas:
        """The output is whole: if nothing is committed, what the whole-output parser reads
        of it, less the content already sent (always the text's start)."""
        out: Deltas = []
        if self.state == "content":
            self._content_rest(out)
        elif not self.committed and self.state != "dropped":
            content, calls = self.parse(self.text)
            if not calls:
                self._content_rest(out)
            else:
                sent = self.text[:self.content_sent]
                rest = (content or "").removeprefix(sent.strip())
                if rest:
                    out.append({"content": rest})
                for c in calls:
                    self.commit(cs, c.name, c.arguments, out)
        self.state = "dropped"
        return out


class _JsonCall:
    """One `{"name": NAME, KEY: {...}, ...}` object read from text[start:] as it comes:
    the call's name once read, then its arguments as they are written; an object whose
    name does not come first, or whose arguments are not an object, is sent whole once it
    closes. `end` is set once the object closes, `failed` when it is not a call."""

    def __init__(self, start: int, head: re.Pattern, args_key: str) -> None:
        self.start, self.head, self.args_key = start, head, args_key
        self.state = "head"          # head | args | tail | whole
        self.scan = _JsonEnd(start)  # where the object ends
        self.args: _JsonArgs | None = None
        self.end: int | None = None
        self.failed = False

    def step(self, r: Reader, cs, out: Deltas) -> None:
        text = r.text
        if self.state == "head":
            m = self.head.match(text, self.start)
            if m is not None:
                j = _skip(text, m.end())
                if j == len(text):
                    return       # the arguments' first character decides how they stream
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = None
                if name is not None and text[j] == "{":
                    r.commit(cs, name, "", out)
                    self.state, self.args = "args", _JsonArgs(j)
                else:
                    self.state = "whole"
            elif self.scan.advance(text) is not None:
                self._whole(r, cs, out, self.scan.pos)
                return
            else:
                return
        if self.state == "args":
            close = self.args.step(text, cs, out)
            if close is None:
                return
            # the rest of the object: the arguments leave it one level deep
            self.state, self.scan = "tail", _JsonEnd(close, depth=1)
        if self.state == "tail":
            if self.scan.advance(text) is not None:
                self.end = self.scan.pos
            return
        if self.state == "whole" and self.scan.advance(text) is not None:
            self._whole(r, cs, out, self.scan.pos)

    def _whole(self, r: Reader, cs, out: Deltas, close: int) -> None:
        try:
            call = call_from_json(json.loads(r.text[self.start:close]), self.args_key)
        except BAD_JSON:
            call = None
        if call is None:
            self.failed = True
            return
        r.commit(cs, call.name, call.arguments, out)
        self.end = close


class Llama3JsonCalls(Reader):
    """`{"name": ..., "parameters": {...}}` objects joined by `;`, optionally after
    `<|python_tag|>`: the whole output is calls, or else content."""

    parse = staticmethod(parse_llama3_json)

    def _step(self, cs, out: Deltas) -> None:
        text = self.text
        while True:
            if self.state == "lead":
                i = skip_space(text, 0)
                if text.startswith(_PYTHON_TAG, i):
                    i = skip_space(text, i + len(_PYTHON_TAG))
                elif could_open(text, i, _PYTHON_TAG):
                    return
                if i == len(text):
                    return
                if text[i] != "{":
                    return self._not_a_call(out)
                self.call, self.state = _JsonCall(i, _LLAMA3_HEAD, "parameters"), "call"
            if self.state == "call":
                if not self._read_call(cs, out):
                    return
                self.state = "between"
            if self.state == "between":
                self.pos = _skip(text, self.pos, _JSON_WS + ";")
                if self.pos == len(text):
                    return
                if text[self.pos] != "{":
                    return self._not_a_call(out)
                self.call, self.state = _JsonCall(self.pos, _LLAMA3_HEAD, "parameters"), "call"


class MistralCalls(Reader):
    """Content, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects, or
    `[TOOL_CALLS]name[ARGS]{...}` per call."""

    parse = staticmethod(parse_mistral)

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self.state = "text"
        self.args: _JsonArgs | None = None   # a name[ARGS] call's arguments

    def _step(self, cs, out: Deltas) -> None:
        text = self.text
        while True:
            if self.state == "text":
                t = text.find(MISTRAL_TOKEN, self.pos)
                # before the token, or before what may be its start
                cut = t if t >= 0 else len(text) - partial_tail(text, MISTRAL_TOKEN)
                shown = cut   # whitespace before a call is not content: held back
                while shown > self.content_sent and text[shown - 1].isspace():
                    shown -= 1
                if shown > self.content_sent:
                    out.append({"content": text[self.content_sent:shown]})
                    self.content_sent = shown
                self.pos = cut
                if t < 0:
                    return
                self.pos, self.state = t + len(MISTRAL_TOKEN), "part"
            if self.state == "part":
                self.pos = _skip(text, self.pos)
                if self.pos == len(text):
                    return
                if text[self.pos] == "[":
                    self.pos, self.state = self.pos + 1, "list"
                else:
                    self.state = "name"
            if self.state == "list":   # after `[` or `,`: an object next
                self.pos = _skip(text, self.pos)
                if self.pos == len(text):
                    return
                if text[self.pos] != "{":
                    return self._not_a_call(out)
                self.call, self.state = _JsonCall(self.pos, _MISTRAL_HEAD, "arguments"), "item"
            if self.state == "item":
                if not self._read_call(cs, out):
                    return
                self.state = "item_end"
            if self.state == "item_end":
                self.pos = _skip(text, self.pos)
                if self.pos == len(text):
                    return
                if text[self.pos] == ",":
                    self.pos, self.state = self.pos + 1, "list"
                    continue
                if text[self.pos] != "]":
                    return self._not_a_call(out)
                self.pos, self.state = self.pos + 1, "after"
            if self.state == "name":
                a = text.find(_MISTRAL_ARGS, self.pos)
                t = text.find(MISTRAL_TOKEN, self.pos)
                if 0 <= t < a or (a < 0 and t >= 0):
                    return self._not_a_call(out)
                if a < 0:
                    return
                j = _skip(text, a + len(_MISTRAL_ARGS))
                if j == len(text):
                    return
                name = text[self.pos:a].strip()
                if not name or text[j] != "{":
                    return self._not_a_call(out)
                self.commit(cs, name, "", out)
                self.args, self.state = _JsonArgs(j), "args"
            if self.state == "args":
                close = self.args.step(text, cs, out)
                if close is None:
                    return
                self.pos, self.state = close, "after"
            if self.state == "after":
                self.pos = _skip(text, self.pos)
                if self.pos == len(text) or could_open(text, self.pos, MISTRAL_TOKEN):
                    return
                if not text.startswith(MISTRAL_TOKEN, self.pos):
                    return self._not_a_call(out)
                self.pos, self.state = self.pos + len(MISTRAL_TOKEN), "part"
