"""The request types every part of the engine shares: what a client asks for
(SamplingParams), the engine's per-request state (Request, written by the step loop and
the poller, each its own fields) and what the client gets back (RequestOutput).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .tokenizer import IncrementalDetokenizer


@dataclass
class SamplingParams:
    """vLLM / OpenAI names. temperature 0 = greedy. top_k 0 or -1 = off.
    max_tokens None = up to max_model_len."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.temperature >= 0.0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is None:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (off) or >= 1")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.seed is not None:
            self.seed = int(self.seed) & 0x7FFFFFFF_FFFFFFFF

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


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    max_tokens: int
    seed: int
    arrival: float = field(default_factory=time.monotonic)
    # step-loop side
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    num_prefilled: int = 0        # prompt tokens whose KV is in the cache
    num_scheduled: int = 0        # output tokens scheduled on the device
    released: bool = False
    # poller side
    out_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    pending: str = ""             # text held back (possible stop-string prefix)
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
