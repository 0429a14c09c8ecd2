"""The engine as the server sees it: one typed interface that the real Engine and the
tests' fake engine both implement. The server reaches the engine through this alone.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from .core.request import RequestOutput, SamplingParams


class SubmitFuture(Future):
    """What submit returns for an engine in another process: request_id is the request's
    id at once (abort takes it); the result is the same id once the engine has queued it,
    or the RequestRejected its submit raised."""

    def __init__(self, request_id: str):
        super().__init__()
        self.request_id = request_id


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
    # the step loop's last step (rows, prefill_tokens, decodes, seconds, at); None before
    # the first: what a stalled engine did last
    last_step: dict[str, Any] | None = None
    # an engine in its own process (engine/process/): its pid and its threads' OS ids by
    # name, which the daemon signals and reads; None for an engine in the server's process
    engine_pid: int | None = None
    engine_threads: dict[str, int] | None = None


class TokenizerLike(Protocol):
    eos_token_ids: list[int]
    # At most this many characters of text per token (text_bound.py), None: no bound.
    # The server refuses longer text than max_model_len tokens could hold, untokenized.
    max_chars_per_token: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


class AdapterLike(Protocol):
    """A LoRA adapter as /v1/models lists it."""
    name: str
    path: str
    base_model_name: str | None


class GrammarCompilerLike(Protocol):
    def compile(self, spec: Any) -> Any:
        """The compiled grammar of a structured-output request (sampling.structured.GrammarSpec),
        set as SamplingParams.grammar; raises GrammarError naming what is wrong. Blocks for
        as long as compiling takes: the server calls it off its event loop."""
        ...


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
               lora: str | None = None) -> str | SubmitFuture:
        """Queue a request; returns its id, or a SubmitFuture of it (an engine in another
        process answers later; the Future then raises what submit would). Raises RequestRejected
        (400/404/429/503).
        after: the id of a request with the same prompt (a sibling of n > 1), submitted
        just before: this one is admitted once that one's prompt is prefilled, so it
        shares the prompt's KV pages through the prefix cache. lora: the name of one of
        `lora_adapters()`, None for the base model."""
        ...

    def abort(self, request_id: str) -> None: ...

    # Structured outputs: the compiler, None for an engine that serves none (the server
    # then refuses response_format / structured_outputs by name). Read off the event loop:
    # the engine builds it on first use.
    grammar_compiler: GrammarCompilerLike | None

    def lora_adapters(self) -> list[AdapterLike]:
        """The LoRA adapters requests can name now; empty without LoRA."""
        ...

    def load_lora(self, name: str, path: str) -> None:
        """Register an adapter (reads its files: call off the event loop). Raises
        EngineError naming what is wrong, or that LoRA is off."""
        ...

    def unload_lora(self, name: str) -> None:
        """New requests for `name` are refused at once. KeyError when none has that name."""
        ...

    def stats(self) -> EngineStats: ...

    def metrics_text(self) -> bytes:
        """The engine's metrics in Prometheus' text format (blocks: off the event loop)."""
        ...

    def shutdown(self, drain_timeout: float = 0.0) -> None: ...
