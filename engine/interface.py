"""The engine as the server sees it: one typed interface that the real Engine and the
tests' fake engine both implement. The server reaches the engine through this alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from .core.request import RequestOutput, SamplingParams


@dataclass
class EngineStats:
    """What /health, the daemon and `zerod top` read of a running engine."""
    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_free: int
    healthy: bool
    device: str
    model: str
    max_model_len: int
    steps: int
    cuda_graphs: bool
    error: str | None = None


class TokenizerLike(Protocol):
    eos_token_ids: list[int]
    # At most this many characters of text per token (text_bound.py), None: no bound.
    # The server refuses longer text than max_model_len tokens could hold, untokenized.
    max_chars_per_token: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


@runtime_checkable
class EngineLike(Protocol):
    model_name: str          # the name the engine was started with (served name or dir name)
    model_path: str          # what /v1/models reports as "root"
    max_model_len: int       # prompt + output tokens of one request, at most
    vocab_size: int          # token ids are in [0, vocab_size)
    tokenizer: TokenizerLike
    metrics: Any             # has .registry, a prometheus_client CollectorRegistry

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], after: str | None = None,
               lora: str | None = None) -> str:
        """Queue a request; returns its id. Raises RequestRejected (400/404/429/503).
        after: the id of a request with the same prompt (a sibling of n > 1), submitted
        just before: this one is admitted once that one's prompt is prefilled, so it
        shares the prompt's KV pages through the prefix cache. lora: a LoRA adapter's
        name (the server passes it only to engines with `lora_adapters`)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self, drain_timeout: float = 0.0) -> None: ...
