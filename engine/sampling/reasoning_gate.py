"""Structured outputs with `--reasoning-parser`: the grammar constrains the answer only,
never the reasoning before it (as vLLM). A request's `ReasoningGate` reads its tokens on
the step thread (structured.GrammarState) until the answer starts; till then its mask
row allows every token and its matcher takes nothing; from the answer's first token on,
the grammar runs from its initial state.

Where the reasoning ends is decided on the decoded text of the generated tokens, fed to
the same `ReasoningStream` the server splits the output with (engine/reasoning.py),
not on the token id of `</think>`: a model may write the tag in several tokens (a
tokenizer without it as one token, or a split the model picks), and the text is what
the server's split reads, so the grammar starts exactly where `content` starts.

qwen3 decides by the output's start (`<think>` opens reasoning, anything else is the
answer), so its first token's mask is the grammar's plus the first token of `<think>`;
once that token is taken, the rest of `<think>` is the only choice (a `<think>` the
tokenizer writes in several tokens is not left half-written).
"""

from __future__ import annotations

from typing import Any

from ..reasoning import THINK_START, ReasoningStream
from ..tokenizer import IncrementalDetokenizer


class ReasoningGate:
    __slots__ = ("stream", "detok", "opening", "opened", "answering")

    def __init__(self, parser: str, tokenizer: Any, prompt_ids: list[int],
                 skip_special_tokens: bool) -> None:
        self.stream = ReasoningStream(parser)
        # the same text the poller detokenizes (engine/core/output.py)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.opening = (tokenizer.encode(THINK_START, add_special_tokens=False)
                        if parser == "qwen3" else [])
        self.opened = 0          # tokens of `opening` written (qwen3's start)
        self.answering = False   # the answer has started: the grammar runs

    @property
    def undecided(self) -> bool:
        """qwen3 before the first token: the grammar's first token or `<think>`'s."""
        return bool(self.opening) and self.opened == 0 and not self.stream.started

    @property
    def forced(self) -> int | None:
        """The one token allowed next (the rest of qwen3's `<think>`), else None."""
        if 0 < self.opened < len(self.opening):
            return self.opening[self.opened]
        return None

    def take(self, token: int) -> tuple[bool, str]:
        """Read one generated token before the answer. Returns (the token is the
        answer's first: the matcher takes it, the answer's text this token ends with
        after `</think>`: the matcher takes it as a string)."""
        if self.undecided and token != self.opening[0]:
            self.answering = True   # qwen3 without thinking: the grammar chose this token
            return True, ""
        if self.opened < len(self.opening) and token == self.opening[self.opened]:
            self.opened += 1
        _, answer = self.stream.feed(self.detok.add(token))
        if self.stream.answering:
            self.answering = True
            return False, answer
        return False, ""
