"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a chat output's thinking split
from its answer, as `reasoning_content` (and `reasoning`, vLLM's newer name) beside
`content`. Tool parsing applies to the answer alone, as in vLLM.

- `deepseek_r1`: the output is reasoning up to `</think>` (the template opens `<think>`
  in the prompt; one at the start of the output is dropped); without `</think>` the whole
  output is reasoning (the model was cut while thinking). Also the parser for models
  whose template opens the thinking (Qwen3 thinking-only releases).
- `qwen3`: an output that starts with `<think>` is reasoning up to `</think>`; one that
  does not is all content (thinking was off: `enable_thinking: false`).

Both parsers: a prompt whose chat template already closed the thinking (it ends with
`</think>`, as Qwen3's does with `enable_thinking: false`) has an output that is all
content (`prompt_closes_thinking`).

`ReasoningStream` does the same split on a stream, piece by piece, holding back only
what may be the start of a tag: a stream and a whole answer split the same way. The
engine runs the same stream on a structured-output request's tokens to know where the
answer, which the grammar constrains, starts (engine/sampling/reasoning_gate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


# The prompt's last tokens decoded to find a closing tag at its end: a few more than
# `</think>` and the whitespace after it take in any tokenizer.
PROMPT_TAIL_TOKENS = 16


def prompt_closes_thinking(prompt_tail: str) -> bool:
    """The chat template closed the thinking in the prompt: its text (the tail of it)
    ends with `</think>` and whitespace. Only the very end counts: an earlier turn's
    thinking kept in the history says nothing of this output."""
    return prompt_tail.rstrip().endswith(THINK_END)


def split_reasoning(parser: str, text: str, closed: bool = False) -> Split:
    """The whole output's reasoning and content (None where there is none); closed: the
    prompt closed the thinking (all content)."""
    r = ReasoningStream(parser, closed)
    reasoning, content = r.feed(text)
    more_r, more_c = r.end()
    return Split((reasoning + more_r) or None, (content + more_c) or None)


class ReasoningStream:
    """The split of a streamed output: feed() -> the (reasoning, content) pieces to send
    now; end() -> what was held back. closed: the prompt closed the thinking, so the
    whole output is content."""

    def __init__(self, parser: str, closed: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of "
                             f"{', '.join(REASONING_PARSERS)}")
        self.parser = parser
        self.held = ""
        self.started = False   # past the output's start (and its `<think>`, if any)
        self.thinking = True   # qwen3: decided by the start
        self.after_end = False  # just past `</think>`: its newlines are dropped
        if closed:
            self.started, self.thinking = True, False

    @property
    def answering(self) -> bool:
        """Past the reasoning (or decided there is none): what follows is the answer."""
        return self.started and not self.thinking

    def feed(self, text: str) -> tuple[str, str]:
        buf = self.held + text
        self.held = ""
        if not self.started:
            stripped = buf.lstrip()
            if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                self.held = buf      # may still become `<think>`
                return "", ""
            self.started = True
            if stripped.startswith(THINK_START):
                buf = stripped[len(THINK_START):]
            elif self.parser == "qwen3":
                self.thinking = False
        reasoning = ""
        if self.thinking:
            end = buf.find(THINK_END)
            if end < 0:
                keep = partial_tail(buf, THINK_END)
                self.held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END):]
            self.thinking, self.after_end = False, True
        if self.after_end:
            buf = buf.lstrip("\n")
            self.after_end = not buf
        return reasoning, buf

    def end(self) -> tuple[str, str]:
        """What is still held back when the output ends."""
        held, self.held = self.held, ""
        if self.thinking and self.started:
            return held, ""
        return "", held


def partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
