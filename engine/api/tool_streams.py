"""Streamed tool calls for the formats that say whether an output is a call only by how
it opens: `llama3_json`, `mistral` and `pythonic` (the whole-output parsers are
tools.parse_llama3_json / parse_mistral / parse_pythonic). Each reader takes the output
as it comes and sends, through a chat_stream.ChoiceStream, what the whole-output parser
will make of it:

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

import ast
import json
import keyword
import re
from typing import Any

from ..reasoning import partial_tail
from .tools import BAD_JSON, MISTRAL_TOKEN, call_from_json, parse_llama3_json, parse_mistral, \
    parse_pythonic

Deltas = list[dict[str, Any]]

_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
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
_IDENT = re.compile(r"[^\W\d]\w*")


def _could_open(text: str, pos: int, tag: str) -> bool:
    """text[pos:] is a proper start of tag (more may complete it)."""
    rest = text[pos:]
    return len(rest) < len(tag) and tag.startswith(rest)


def _skip(text: str, pos: int, chars: str = _JSON_WS) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _skip_space(text: str, pos: int) -> int:
    """After any whitespace from pos (str.strip's, as the whole-output parsers strip)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _skip_py(text: str, pos: int) -> int | None:
    """After Python's whitespace and comments from pos, or None: the text ends in them."""
    while pos < len(text):
        if text[pos] == "#":
            nl = text.find("\n", pos)
            if nl < 0:
                return None
            pos = nl + 1
        elif text[pos] in " \t\r\n\f":
            pos += 1
        elif text[pos] == "\\":         # a line continuation
            if pos + 1 == len(text):
                return None
            if text[pos + 1] != "\n":
                return pos
            pos += 2
        else:
            return pos
    return None


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


class _Reader:
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

    def step(self, r: _Reader, cs, out: Deltas) -> None:
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

    def _whole(self, r: _Reader, cs, out: Deltas, close: int) -> None:
        try:
            call = call_from_json(json.loads(r.text[self.start:close]), self.args_key)
        except BAD_JSON:
            call = None
        if call is None:
            self.failed = True
            return
        r.commit(cs, call.name, call.arguments, out)
        self.end = close


class Llama3JsonCalls(_Reader):
    """`{"name": ..., "parameters": {...}}` objects joined by `;`, optionally after
    `<|python_tag|>`: the whole output is calls, or else content."""

    parse = staticmethod(parse_llama3_json)

    def _step(self, cs, out: Deltas) -> None:
        text = self.text
        while True:
            if self.state == "lead":
                i = _skip_space(text, 0)
                if text.startswith(_PYTHON_TAG, i):
                    i = _skip_space(text, i + len(_PYTHON_TAG))
                elif _could_open(text, i, _PYTHON_TAG):
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


class MistralCalls(_Reader):
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
                if self.pos == len(text) or _could_open(text, self.pos, MISTRAL_TOKEN):
                    return
                if not text.startswith(MISTRAL_TOKEN, self.pos):
                    return self._not_a_call(out)
                self.pos, self.state = self.pos + len(MISTRAL_TOKEN), "part"


def _name(word: str) -> bool:
    """A Python name (not a keyword such as `if` or `None`)."""
    return word.isidentifier() and not keyword.iskeyword(word)


class _PyEnd:
    """Where a Python expression in a call's argument list ends: the index of the first
    `,` or closing bracket outside brackets, strings and comments, found as the text
    comes."""

    def __init__(self, pos: int) -> None:
        self.pos, self.depth = pos, 0
        self.quote = ""   # the open string's quote: ', ", ''' or \"\"\"
        self.comment = False

    def advance(self, text: str) -> int | None:
        i, n = self.pos, len(text)
        while i < n:
            c = text[i]
            if self.comment:
                self.comment = c != "\n"
            elif self.quote:
                if c == "\\":
                    if i + 1 == n:
                        break          # what it escapes is still coming
                    i += 1
                elif c == self.quote[0]:
                    if len(self.quote) == 3:
                        if _could_open(text, i, self.quote):
                            break      # the close, or a quote inside: not known yet
                        if text.startswith(self.quote, i):
                            self.quote, i = "", i + 2
                    else:
                        self.quote = ""
            elif c in "'\"":
                if _could_open(text, i, c * 3):
                    break              # a triple quote or an empty string: not known yet
                if text.startswith(c * 3, i):
                    self.quote, i = c * 3, i + 2
                else:
                    self.quote = c
            elif c == "#":
                self.comment = True
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    self.pos = i
                    return i
                self.depth -= 1
            elif c == "," and self.depth == 0:
                self.pos = i
                return i
            i += 1
        self.pos = i
        return None


class PythonicCalls(_Reader):
    """`[f(a=1, b="x"), g()]`, optionally inside `<|python_start|>` … `<|python_end|>`:
    the whole output is calls, or else content. A keyword argument is sent once its value
    closes (the value must be a literal); a call's name goes with its first argument."""

    parse = staticmethod(parse_pythonic)

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self.wrapped = False   # inside <|python_start|>
        self.calls = 0
        self.name: str | None = None   # the call read, not yet sent
        self.keys: set[str] = set()
        self.value: _PyEnd | None = None   # the keyword argument's value being read
        self.value_key: str | None = None  # its keyword (None: a `**mapping`)
        self.value_start = 0

    def _step(self, cs, out: Deltas) -> None:
        text = self.text
        while True:
            if self.state == "lead":
                i = _skip_space(text, 0)
                if text.startswith(_PYTHON_START, i):
                    i, self.wrapped = _skip_space(text, i + len(_PYTHON_START)), True
                elif _could_open(text, i, _PYTHON_START):
                    return
                if i == len(text):
                    return
                if text[i] != "[":
                    return self._not_a_call(out)
                self.pos, self.state = i + 1, "list"
            if self.state == "list":   # a call's name and its `(` next (or `]` after a `,`)
                j = _skip_py(text, self.pos)
                if j is None:
                    return
                self.pos = j
                if text[self.pos] == "]" and self.calls:
                    self.pos, self.state = self.pos + 1, "after"
                    continue
                m = _IDENT.match(text, self.pos)
                if m is not None and m.end() == len(text):
                    return       # the name may go on
                if m is None or not _name(m.group()):
                    return self._not_a_call(out)
                j = _skip_py(text, m.end())
                if j is None:
                    return
                if text[j] != "(":
                    return self._not_a_call(out)
                # the name goes out with the first argument (or the `)`): `[word(` alone
                # is not yet a call
                self.name, self.calls = m.group(), self.calls + 1
                self.pos, self.state, self.keys = j + 1, "kwargs", set()
            if self.state == "kwargs":   # the next keyword, or `)`
                j = _skip_py(text, self.pos)
                if j is None:
                    return
                self.pos = j
                if text[self.pos] == ")":
                    self._send("}" if self.keys else "{}", cs, out)
                    self.pos, self.state = self.pos + 1, "call_end"
                elif text.startswith("**", self.pos):
                    # `**mapping` names no keyword: the whole-output parser skips it
                    self.value, self.value_key = _PyEnd(self.pos + 2), None
                    self.value_start = self.pos + 2
                    self.state = "value"
                elif text[self.pos] == "*" and self.pos + 1 == len(text):
                    return
                else:
                    m = _IDENT.match(text, self.pos)
                    if m is not None and m.end() == len(text):
                        return   # the keyword may go on
                    if m is None or not _name(m.group()):
                        return self._not_a_call(out)
                    j = _skip_py(text, m.end())
                    if j is None or (text[j] == "=" and j + 1 == len(text)):
                        return
                    if text[j] != "=" or text[j + 1] == "=" or m.group() in self.keys:
                        return self._not_a_call(out)
                    self.value, self.value_key = _PyEnd(j + 1), m.group()
                    self.value_start = j + 1
                    self.state = "value"
            if self.state == "value":
                end = self.value.advance(text)
                if end is None:
                    return
                piece = self._argument(text[self.value_start:end])
                if piece is None or text[end] not in ",)":
                    return self._not_a_call(out)
                if piece:
                    self._send(piece, cs, out)
                # after `,`: a keyword or `)`; a `)` is read in kwargs
                self.pos, self.state = ((end + 1, "kwargs_next") if text[end] == ","
                                        else (end, "kwargs"))
            if self.state == "kwargs_next":   # after `,`: a keyword or `)`, not another `,`
                j = _skip_py(text, self.pos)
                if j is None:
                    return
                self.pos = j
                if text[self.pos] == ",":
                    return self._not_a_call(out)
                self.state = "kwargs"
                continue
            if self.state == "call_end":
                j = _skip_py(text, self.pos)
                if j is None:
                    return
                self.pos = j
                if text[self.pos] == ",":
                    self.pos, self.state = self.pos + 1, "list"
                elif text[self.pos] == "]":
                    self.pos, self.state = self.pos + 1, "after"
                else:
                    return self._not_a_call(out)
            if self.state == "after":
                j = _skip_py(text, self.pos)
                if j is None:
                    return
                self.pos = j
                if self.wrapped and text.startswith(_PYTHON_END, self.pos):
                    self.pos, self.wrapped = self.pos + len(_PYTHON_END), False
                    continue
                if self.wrapped and _could_open(text, self.pos, _PYTHON_END):
                    return
                return self._not_a_call(out)

    def _send(self, arguments: str, cs, out: Deltas) -> None:
        if self.name is not None:
            self.commit(cs, self.name, "", out)
            self.name = None
        out.append(cs.args_delta(arguments))

    def _argument(self, source: str) -> str | None:
        """`"key": value` as JSON (after `{` or `, `); "" for a `**mapping` (the
        whole-output parser skips it, but it must be an expression); None: not a literal."""
        # read in a call, as written: a value may span lines and end in a comment
        head = "f(**" if self.value_key is None else "f(x="
        try:
            call = ast.parse(head + source + "\n)", mode="eval").body
            if self.value_key is None:
                return ""
            value = ast.literal_eval(call.keywords[0].value)
            piece = json.dumps(value, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        lead = ", " if self.keys else "{"
        self.keys.add(self.value_key)
        return lead + json.dumps(self.value_key) + ": " + piece
