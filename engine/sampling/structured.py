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
  pinned buffer (`fill_masks`, xgrammar's batch fill: on the step thread up to
  POOL_ROWS rows, its thread pool beyond), copies them, and launches
  step N+1's sampling, where `grammar_mask.apply_bitmask` sets disallowed logits to -inf
  before any other sampling rule (grammar_mask.MaskStaging). Masked rows are in every
  step; batches without one keep the full pipelining (several steps in flight).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reasoning_gate import ReasoningGate

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
    """A compiled xgrammar grammar (GrammarCompiler.compile)."""
    grammar: Any


class GrammarError(ValueError):
    """A grammar that does not compile: the client's fault (a 400)."""


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in s)


class GrammarCompiler:
    """The engine's xgrammar compilers (cached), built for its tokenizer and vocabulary.

    The masks cover the tokenizer's ids only (`mask_words` int32 words; apply_bitmask
    refuses every id past them): ids the model's vocabulary pads on would be walked one by
    one for every row by xgrammar (a 384-entry tokenizer in a 128,256-id model: 11 ms of
    fill and 2 ms of advance a step for 64 rows, against 0.1 ms without them;
    gpu/mask_fill.py).

    JSON grammars compile against a vocabulary with no token holding a control character:
    xgrammar 0.2.9's rule for a string with maxLength admits raw control characters, which
    JSON forbids (json.loads refuses them), and compact JSON holds none anywhere. Erasing
    them from the vocabulary (an empty token is never allowed) costs nothing a step, where
    ANDing a rule into every row cost 0.7 ms a step for 64 rows."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        hf = tokenizer._tok
        # whole words past the tokenizer's last id: no partial word, whose high bits xgrammar sets
        n = min(vocab_size, -(-tokenizer.vocab_size // 32) * 32)
        self.mask_words = (n + 31) // 32
        encoded = [hf.id_to_token(i) or "" for i in range(min(n, tokenizer.vocab_size))]
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        stops = [i for i in tokenizer.eos_token_ids if i < n]

        def info(tokens: list[str]) -> Any:
            return xgr.TokenizerInfo(tokens, meta["vocab_type"], vocab_size=n,
                                     stop_token_ids=stops or None,
                                     add_prefix_space=meta["add_prefix_space"])
        self.info = info(encoded)
        no_ctrl = [("" if i not in stops and any(x < 0x20 for x in b) else t)
                   for i, (t, b) in enumerate(zip(encoded, self.info.decoded_vocab))]
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)
        self._json_compiler = xgr.GrammarCompiler(info(no_ctrl), max_threads=2, cache_enabled=True)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (blocking: call it off the event loop)."""
        compiled = self._compile(spec)
        self._check_first_token(compiled, spec)
        return CompiledGrammar(compiled)

    def _check_first_token(self, compiled: Any, spec: GrammarSpec) -> None:
        """Refuse a grammar that compiles but admits no first token (`root ::= root`, rules
        that only refer to each other): its request could never produce anything, and the
        step loop would find an all-refusing mask. One mask fill, about a millisecond."""
        xgr = self._xgr
        try:
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
            matcher.fill_next_token_bitmask(mask)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
            raise GrammarError(f"the {spec.kind} cannot start: "
                               f"{str(exc).strip().splitlines()[0][:300]}") from None
        if not bool(mask.any()):
            raise GrammarError(f"the {spec.kind} admits no first token: a rule that only "
                               "refers to itself (such as root ::= root) matches nothing")

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._json_compiler if spec.kind == "json" else self._compiler
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

    def new_state(self, compiled: CompiledGrammar, gate: ReasoningGate | None = None
                  ) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled.grammar), self.mask_words, gate)


class GrammarState:
    """One request's matcher (the step thread's, after the submit), the width of its
    mask rows in int32 words (its compiler's) and, with a reasoning parser, the gate
    that holds the grammar back until the answer starts (reasoning_gate.py)."""

    __slots__ = ("matcher", "words", "gate")

    def __init__(self, matcher: Any, words: int, gate: ReasoningGate | None = None) -> None:
        self.matcher, self.words, self.gate = matcher, words, gate

    @property
    def terminated(self) -> bool:
        """It accepted a stop token: the output is whole (later tokens are discarded)."""
        return self.matcher.is_terminated()

    @property
    def gated(self) -> bool:
        """The output is still before its answer: the grammar does not run yet."""
        return self.gate is not None and not self.gate.answering

    def take_gated(self, token: int) -> bool | None:
        """A token read by the gate: None where it is the answer's first token (the
        matcher takes it), else True."""
        first, text = self.gate.take(token)
        if first:
            return None
        if text and not self.matcher.accept_string(text):
            # The token that ends the reasoning also carries answer text the grammar
            # refuses (`</think>` and more in one token, which the reasoning's unmasked
            # row allows): the grammar starts after that token instead.
            self.matcher.reset()
        return True


# Up to this many rows a step's masks are filled on the step thread: xgrammar's thread pool
# costs more than it saves there (64 rows of a JSON schema, 128k vocabulary: 0.45 ms on one
# thread, 0.9 ms on two; gpu/mask_fill.py), and a pool stalls on a busy host.
POOL_ROWS = 128
_POOLS: dict[bool, Any] = {}   # xgrammar BatchGrammarMatchers: one thread / a pool
# A batch matcher is not safe to fill from two threads at once, and the pools are the
# process's: the step thread and an engine's start-up warm-up (or a second engine in the
# same process) take turns. Uncontended on a serving engine's step thread.
_POOLS_LOCK = threading.Lock()


def _batch(rows: int) -> Any:
    pooled = rows > POOL_ROWS
    b = _POOLS.get(pooled)
    if b is None:
        import xgrammar as xgr
        b = _POOLS[pooled] = xgr.BatchGrammarMatcher(
            max_threads=min(8, os.cpu_count() or 1) if pooled else 1)
    return b


def advance_all(states: list[GrammarState], tokens: list[int]) -> list[bool]:
    """Each matcher takes its token (a gated state's gate reads it instead); False where
    the grammar refuses it (cannot happen for a masked row: a bug, reported as an error)."""
    import xgrammar as xgr
    ok = [True] * len(states)
    taken = []
    for k, (g, t) in enumerate(zip(states, tokens)):
        if not g.gated or g.take_gated(t) is None:
            taken.append(k)
    if taken:
        got = xgr.BatchGrammarMatcher.batch_accept_token([states[k].matcher for k in taken],
                                                         [tokens[k] for k in taken])
        for k, accepted in zip(taken, got):
            ok[k] = accepted
    return ok


def _allow(bitmask: Any, row: int, token: int) -> None:
    """Set token's bit in a mask row (int32 words: bit 31 is the sign)."""
    w, b = divmod(token, 32)
    word = (int(bitmask[row, w]) & 0xFFFFFFFF) | (1 << b)
    bitmask[row, w] = word - (1 << 32) if word >= 1 << 31 else word


def fill_masks(states: list[GrammarState], bitmask: Any, indices: list[int]) -> None:
    """Fill bitmask rows `indices` (int32 [rows, words], CPU) with each state's next-token
    mask; a terminated state's row allows everything (its token is discarded), and so
    does a gated one's (its reasoning is free), but for qwen3's start (reasoning_gate.py)."""
    live, rows, extra = [], [], []
    for g, i in zip(states, indices):
        if g.terminated:
            bitmask[i] = -1
        elif g.gated and g.gate.forced is not None:
            bitmask[i] = 0
            _allow(bitmask, i, g.gate.forced)
        elif g.gated and not g.gate.undecided:
            bitmask[i] = -1
        else:
            live.append(g.matcher)
            rows.append(i)
            if g.gated:   # the grammar's first token, or `<think>`'s
                extra.append((i, g.gate.opening[0]))
    if live:
        with _POOLS_LOCK:
            _batch(len(live)).batch_fill_next_token_bitmask(live, bitmask, rows)
    for i, token in extra:
        _allow(bitmask, i, token)


def warm(compiler: GrammarCompiler) -> None:
    """Every kind of grammar compiled once, a matcher built, masks filled through both
    batch paths and a token accepted: xgrammar's lazy parts (its import, the tokenizer
    info, the batch matchers, the thread pool) are paid before READY, not by a request."""
    import torch
    kinds = [GrammarSpec("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
             GrammarSpec("regex", "[a-z]+"), GrammarSpec("choice", '["yes", "no"]'),
             GrammarSpec("grammar", 'root ::= "a" | "b"')]
    compiled = [compiler.compile(s) for s in kinds]
    for rows in (len(kinds), POOL_ROWS + 1):   # the one-thread path, then the pool's
        # a matcher per row: the pool fills rows in parallel, and a matcher is not thread-safe
        states = [compiler.new_state(compiled[i % len(kinds)]) for i in range(rows)]
        fill_masks(states, torch.zeros(rows, states[0].words, dtype=torch.int32), list(range(rows)))
    advance_all(states[:1], [0])
