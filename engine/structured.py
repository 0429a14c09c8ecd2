"""Structured outputs with xgrammar: a grammar per request, its token mask on the device.

This module is the host side (no torch import: protocol.py reads its limits); the
device side is grammar_mask.py.

How a masked row runs (docs/engine-server.md, "Structured outputs"):
- The server compiles the request's grammar (JSON schema, regex, choice, EBNF) on its
  tokenize pool, never on the event loop; `GrammarCompiler` caches compiled grammars, so
  a schema sent again costs a lookup.
- The engine gives the request a `GrammarState` (an xgrammar matcher); from then on only
  the step thread touches it.
- The mask of token N+1 depends on token N, so the mask is computed on the CPU while the
  GPU runs the step's forward (as vLLM and SGLang overlap it): the step thread launches
  step N+1's forward (its decode input, last_tokens, is on the device), then waits for
  step N's ids, advances the matchers of its masked rows, fills their bitmask rows into a
  pinned buffer (`fill_masks`, xgrammar's threaded batch fill), copies them, and launches
  step N+1's sampling, where `grammar_mask.apply_bitmask` sets disallowed logits to -inf
  before any other sampling rule (grammar_mask.MaskStaging). Masked rows are in every
  step; batches without one keep the full pipelining (several steps in flight).
"""

from __future__ import annotations

import json
import os
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
    """One request's matcher (the step thread's, after the submit)."""

    __slots__ = ("allowed", "matcher")

    def __init__(self, xgr: Any, compiled: CompiledGrammar, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.allowed = compiled.allowed

    @property
    def terminated(self) -> bool:
        """It accepted a stop token: the output is whole (later tokens are discarded)."""
        return self.matcher.is_terminated()


_BATCH: Any = None   # one xgrammar BatchGrammarMatcher (its thread pool) per process


def _batch() -> Any:
    global _BATCH
    if _BATCH is None:
        import xgrammar as xgr
        _BATCH = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
    return _BATCH


def advance_all(states: list[GrammarState], tokens: list[int]) -> list[bool]:
    """Each matcher takes its token; False where the grammar refuses it (cannot happen
    for a masked row: a bug, reported as an error)."""
    return _batch().batch_accept_token([g.matcher for g in states], tokens)


def fill_masks(states: list[GrammarState], bitmask: Any, indices: list[int]) -> None:
    """Fill bitmask rows `indices` (int32 [rows, W], CPU) with each state's next-token
    mask; a terminated state's row allows everything (its token is discarded)."""
    live, done = [], []
    for g, i in zip(states, indices):
        (done if g.terminated else live).append((g, i))
    for _, i in done:
        bitmask[i] = -1
    if not live:
        return
    _batch().batch_fill_next_token_bitmask([g.matcher for g, _ in live], bitmask,
                                           [i for _, i in live])
    json_rows = [(g.allowed, i) for g, i in live if g.allowed is not None]
    if json_rows:   # every JSON grammar shares its compiler's one `allowed` row
        bitmask[[i for _, i in json_rows]] &= json_rows[0][0]
