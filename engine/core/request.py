"""The request types every part of the engine shares: what a client asks for
(SamplingParams), the engine's per-request state (Request, written by the step loop and
the poller, each its own fields) and what the client gets back (RequestOutput).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from ..reasoning import REASONING_PARSERS
from ..sampling.logprobs import MAX_LOGPROBS
from ..tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from ..lora import LoraAdapter
    from .prefix_cache import PageChain
    from ..sampling.structured import GrammarState


# The penalties' ranges (vLLM's); the HTTP schema imports them (engine/api/protocol.py).
PENALTY_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
                  "repetition_penalty": (1e-6, 2.0)}

INT64_MAX = 2**63 - 1            # the device tables hold token ids, top_k, seeds, min_tokens as int64
FLOAT32_MAX = 3.4028234663852886e38
GREEDY_BELOW = 1e-5              # a temperature below this samples greedily (as vLLM does)


def _int(name: str, v, lo: int, hi: int = INT64_MAX) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    return float(v)


@dataclass
class SamplingParams:
    """vLLM / OpenAI names. temperature 0 = greedy. top_k 0 or -1 = off.
    max_tokens None = up to max_model_len. Every value is checked to fit what the device
    tables hold (ValueError naming the field), when built and again at submit."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added logit
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None          # top alternatives per output token (0: the chosen one only)
    prompt_logprobs: int | None = None   # the same per prompt token (prompt_logprobs.py)
    # a compiled xgrammar grammar (structured.GrammarCompiler.compile): outputs follow it
    grammar: Any = None
    # the --reasoning-parser whose reasoning the grammar leaves free: it constrains the
    # answer after it (sampling/reasoning_gate.py); None: the whole output
    reasoning_parser: str | None = None
    # the daemon's canary (header X-Zerod-Canary): served like any request, kept out of the
    # latency histograms and token / request counters its baseline and the users' metrics read
    unmetered: bool = False

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = -1
        self.check()
        self.stop = [s for s in self.stop if s]
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if self.seed is not None:
            self.seed &= INT64_MAX

    def check(self) -> None:
        """Raise ValueError naming the first field out of range."""
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        t = _real("temperature", self.temperature)
        if not 0.0 <= t <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        p = _real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        _int("top_k", self.top_k, -1)
        for name, (lo, hi) in PENALTY_RANGES.items():
            v = _real(name, getattr(self, name))
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        if len(self.logit_bias) > 300:
            raise ValueError(f"logit_bias holds at most 300 entries, got {len(self.logit_bias)}")
        for t_id, b in self.logit_bias.items():
            _int("logit_bias", t_id, 0)
            if not -100.0 <= _real("logit_bias", b) <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        mp = _real("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")   # any size: folded to 63 bits
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        for t_id in self.stop_token_ids:
            _int("stop_token_ids", t_id, 0)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    def for_vocab(self, vocab_size: int) -> "SamplingParams":
        """These params for a model of vocab_size tokens: stop ids must be in it, and a
        top_k of the whole vocabulary or more is off. Returns self when nothing changes."""
        for t_id in self.stop_token_ids:
            _int("stop_token_ids", t_id, 0, vocab_size - 1)
        for t_id in self.logit_bias:
            _int("logit_bias", t_id, 0, vocab_size - 1)
        if self.top_k >= vocab_size:
            return replace(self, top_k=-1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]          # new ids since the last output
    text: str                     # new text since the last output (valid UTF-8, no stop string)
    finished: bool
    finish_reason: str | None     # "stop" | "length" | "abort" | "error" | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0        # prompt tokens whose KV came from the prefix cache
    logprobs: list | None = None  # logprobs.TokenLogprob of each id in token_ids (asked for)
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token (asked for; first output only)


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    max_tokens: int
    seed: int
    sample_class: int = 1         # sampler.row_class of the params: decode rows are grouped by it
    grammar: GrammarState | None = None  # structured outputs: advanced by the poller
    arrival: float = field(default_factory=time.monotonic)
    after: str | None = None      # a sibling (n > 1): the request with its prompt, whose prefill it waits for
    lora: LoraAdapter | None = None  # the LoRA adapter it runs with (None: the base model)
    # step-loop side
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    on_device: bool = False       # its slot-table rows (pages, sampling params) are written
    lora_slot: int = 0            # its adapter's device slot while admitted (0: none)
    scheduled_at: float | None = None  # when it left the wait line (vLLM's queue / prefill split)
    num_prefilled: int = 0        # prompt tokens whose KV is in the cache
    num_cached: int = 0           # of which the prefix cache had before the request came
    chain: PageChain | None = None  # its published prefix pages (prefix_cache.py)
    num_scheduled: int = 0        # output tokens scheduled on the device
    released: bool = False
    # poller side
    out_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    pending: str = ""             # text held back (possible stop-string prefix)
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token so far (prompt_logprobs.py)
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
