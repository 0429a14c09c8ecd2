"""The `pythonic` format's streamed tool calls: `[f(a=1, b="x"), g()]`, read as the
output comes (tool_streams.py says what a reader sends and when)."""

from __future__ import annotations

import ast
import json
import keyword
import re

from .tool_streams import Deltas, Reader, could_open, skip_space
from .tools import parse_pythonic

_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[^\W\d]\w*")


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
                        if could_open(text, i, self.quote):
                            break      # the close, or a quote inside: not known yet
                        if text.startswith(self.quote, i):
                            self.quote, i = "", i + 2
                    else:
                        self.quote = ""
            elif c in "'\"":
                if could_open(text, i, c * 3):
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


class PythonicCalls(Reader):
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
                i = skip_space(text, 0)
                if text.startswith(_PYTHON_START, i):
                    i, self.wrapped = skip_space(text, i + len(_PYTHON_START)), True
                elif could_open(text, i, _PYTHON_START):
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
                if self.wrapped and could_open(text, self.pos, _PYTHON_END):
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
