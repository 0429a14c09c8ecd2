"""Structured outputs with xgrammar: a grammar per request, its token mask on the device.

This module is the host side (no torch import: protocol.py reads its limits); the
device side is grammar_mask.py.

How a masked row runs (docs/engine-server.md, "Structured outputs"):
- The server compiles the request's grammar (JSON schema, regex, choice, EBNF) on its
  tokenize pool, never on the event loop; `GrammarCompiler` caches compiled grammars, so
  a schema sent again costs a lookup.
- The engine gives the request a `GrammarState`: an xgrammar matcher and the request's
  own host bitmask row, filled for the first token at submit.
- The step loop ships the masks of the step's masked rows with the step's inputs (one
  pinned copy per step) and `grammar_mask.apply_bitmask` sets disallowed logits to -inf
  before any other sampling rule.
- The mask of token N+1 depends on token N, which the host learns only in the output
  poller: the poller advances the matcher and fills the next mask, then wakes the step
  loop. A masked row therefore has at most one step in flight (`GrammarState.ready`):
  while the step loop prepares step N+1 during step N, it leaves such rows out; they
  join the next step once their mask is filled. Unmasked rows never wait.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_GRAMMAR_CHARS = 65536   # a schema / regex / grammar text longer than this is refused
MAX_CHOICE_OPTIONS = 256   # strings a structured-output choice list may hold


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. kind: json (value: a schema as JSON
    text), regex, choice (value: a JSON list of strings), grammar
    (EBNF)."""
    kind: str
    value: str
    param: str = ""   # the request field it came from (named by a 400)

    def describe(self) -> str:
        return f"{self.kind} {self.value or ''}"[:80]


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar and, for JSON, the tokens it must never pick: xgrammar 0.2.9's
    rule for a string with maxLength admits raw control characters, which JSON forbids
    (json.loads refuses them). Compact JSON holds no raw control character anywhere, so a
    JSON grammar's mask also drops every token whose bytes hold one (`allowed`)."""
    grammar: Any
    allowed: Any = None   # int32 [1, W] bitmask ANDed into every mask; None: no extra rule


class GrammarError(ValueError):
    """A grammar that does not compile: the client's fault (a 400)."""


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in s)


class GrammarCompiler:
    """The engine's xgrammar compiler (cached), built for its tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        hf = tokenizer._tok
        encoded = [hf.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        self.info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=list(tokenizer.eos_token_ids) or None,
                                      add_prefix_space=meta["add_prefix_space"])
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)
        self._json_allowed = None

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (blocking: call it off the event loop)."""
        if spec.kind == "json":
            return CompiledGrammar(self._compile(spec), self._no_control_chars())
        return CompiledGrammar(self._compile(spec))

    def _no_control_chars(self) -> Any:
        """int32 [1, W]: bit v set unless token v's bytes hold a control character."""
        if self._json_allowed is None:
            import numpy as np
            import torch

            ok = np.ones(((self.vocab_size + 31) // 32) * 32, dtype=bool)
            for i, b in enumerate(self.info.decoded_vocab):
                ok[i] = not any(x < 0x20 for x in b)
            # little-endian bit order: bit k of word w is token 32 w + k (xgrammar's layout)
            words = np.packbits(ok, bitorder="little").view("<i4")
            self._json_allowed = torch.from_numpy(words.astype(np.int32)).unsqueeze(0)
        return self._json_allowed

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json":
                return c.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                alts = "|".join("(" + _regex_escape(s) + ")" for s in json.loads(spec.value))
                return c.compile_regex(alts)
            if spec.kind == "grammar":
                return c.compile_grammar(spec.value)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
            raise GrammarError(f"the {spec.kind} does not compile: "
                               f"{str(exc).strip().splitlines()[0][:300]}") from None
        raise GrammarError(f"unknown structured output kind {spec.kind!r}")

    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        return GrammarState(self._xgr, compiled, self.vocab_size)


class GrammarState:
    """One request's matcher and host mask row. Written by the poller only (after the
    submit); the step loop reads `mask` when `ready` says it holds the next token's mask."""

    __slots__ = ("accepted", "allowed", "mask", "matcher")

    def __init__(self, xgr: Any, compiled: CompiledGrammar, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)   # int32 [1, ceil(V/32)], CPU
        self.allowed = compiled.allowed
        self._fill()
        self.accepted = 0   # output tokens the matcher has taken; `mask` is for the next one

    def ready(self, scheduled: int) -> bool:
        """True when the mask of output token `scheduled` is filled (the poller is level)."""
        return self.accepted == scheduled

    def advance(self, token: int) -> bool:
        """Take a sampled token and fill the next mask; False if the grammar refuses it
        (cannot happen for a masked row: a bug, reported as an error)."""
        if not self.matcher.accept_token(token):
            return False
        if not self.matcher.is_terminated():
            self._fill()
        self.accepted += 1
        return True

    def _fill(self) -> None:
        self.matcher.fill_next_token_bitmask(self.mask)
        if self.allowed is not None:
            self.mask &= self.allowed
