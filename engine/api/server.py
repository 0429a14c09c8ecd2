"""The OpenAI-compatible HTTP server (aiohttp) in front of an engine (`EngineLike`).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream
true/false), POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics,
GET /openapi.json; with --allow-runtime-lora, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. A request names a LoRA adapter in `model`. See docs/engine-server.md. Every answer carries X-Request-Id and, for
an allowed origin, CORS headers (cors.py).
The connection-level limits and error shapes live in http_edge.py.

CPU work of a request (tokenizing, rendering the chat template) runs inline only for short
text; longer text goes to a small thread pool (`tokenizers` releases the GIL while
encoding), so a large prompt cannot stall /health or other streams. Text that could never
fit max_model_len is refused before it is tokenized at all (protocol.Limits).

Hand-off from the engine: `on_output` runs on the engine's poller thread. It appends
(request state, output) to one shared inbox and, only when no wake-up is pending yet,
schedules a drain on the event loop with `call_soon_threadsafe`. So a poller burst of
outputs for 200 streams costs one self-pipe write, not 200. Once a stream's headers are
out (aiohttp sends them at prepare; one that holds them for the first body write gets
that write through a waiter), the drain itself formats what piled up for each stream and
writes it to the transport in one chunk-framed write: no task wake-up, future or
coroutine per token, the first token included (measured ~15 % less HTTP-thread CPU per
token than waking each stream's handler; the rest is mostly the send syscall).
Non-streamed requests go through a per-request waiter.

Client gone: the app runs with handler cancellation, so a disconnect cancels the
handler (stream or not) and its `finally` calls `engine.abort(rid)`; a failed write does
the same.

SIGTERM / SIGINT: `/health` and new requests answer 503 at once; in-flight requests get
`drain_timeout` seconds to finish; the rest are aborted and their streams end with
finish_reason "abort" and `[DONE]`; then the listener closes, the engine shuts down and
the process exits 0.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from zerod.engine.api import protocol as P
from zerod.engine.config import RequestRejected
from zerod.engine.api.access_log import TALLY, access_middleware, log_request
from zerod.engine.api.cors import CorsPolicy, request_id
from zerod.engine.core.first_use import FIRST_USES
from zerod.engine.generation_defaults import apply_defaults
from zerod.engine.api.http_edge import EdgeLimits, EdgeRunner, bind_socket, edge_error
from zerod.engine.interface import EngineLike, SubmitFuture
from zerod.engine.metrics import CANARY_HEADER
from zerod.engine.api.openapi import openapi_document
from zerod.engine.api.response_size import check_response_size, encode_sliced
from zerod.engine.sampling.structured import GrammarError, GrammarSpec
from zerod.engine.api.chat_stream import ChoiceStream
from zerod.engine.reasoning import PROMPT_TAIL_TOKENS, prompt_closes_thinking, split_reasoning
from zerod.engine.api.tools import outcome

log = logging.getLogger("zerod.engine.api.server")

# Text up to this many characters is tokenized inline: ~1-2 ms at worst, less than the
# hop to a thread, so short prompts ("Hello": the idle TTFT figure) pay nothing extra.
TOKENIZE_INLINE_CHARS = 2048
TOKENIZE_THREADS = 2
# Threads that build and encode non-streamed answers (the event loop never does).
RESPOND_THREADS = 2
# A runtime LoRA load reads files a client names on a thread of its own; past this the
# client is answered (the read itself is bounded: engine/lora/adapter.py).
LORA_LOAD_TIMEOUT_S = 60

REQUEST_ID = web.RequestKey("request_id", str)  # the request's X-Request-Id (cors.request_id)
_ABORTED = object()  # pushed into a stream by the server itself when draining ends it


class _Req:
    """One request's hand-off state (touched only on the event loop)."""

    __slots__ = ("error", "finished", "items", "rid", "sink", "touched", "waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiter: asyncio.Future | None = None
        self.finished = False
        self.rid: Any = None
        self.error: str | None = None
        self.sink: Callable[[], None] | None = None  # set once a stream writes directly
        self.touched = False


class OutputRouter:
    """Poller thread -> event loop, batched: one wake-up per burst, not per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.inbox: collections.deque = collections.deque()
        self.scheduled = False
        self.wakeups = 0  # drains run (for tests / tuning)
        self.delivered = 0

    def callback(self, st: _Req, index: int | None = None) -> Callable[[Any], None]:
        """The engine's on_output for st; with index (one of several choices), the
        outputs arrive as (index, output)."""
        inbox = self.inbox

        def on_output(out: Any) -> None:  # poller thread
            inbox.append((st, out if index is None else (index, out)))
            if not self.scheduled:
                self.scheduled = True
                try:
                    self.loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # loop closed at shutdown
                    pass

        return on_output

    def _drain(self) -> None:
        self.scheduled = False  # before popping: a later append schedules a new drain
        self.wakeups += 1
        inbox = self.inbox
        popleft = inbox.popleft
        n = len(inbox)
        self.delivered += n
        touched = []
        for _ in range(n):
            st, out = popleft()
            st.items.append(out)
            if st.sink is not None:
                if not st.touched:
                    st.touched = True
                    touched.append(st)
                continue
            w = st.waiter
            if w is not None:
                st.waiter = None
                if not w.done():
                    w.set_result(None)
        for st in touched:  # one write per stream per wake-up
            st.touched = False
            st.sink()


async def _next_items(st: _Req, loop: asyncio.AbstractEventLoop) -> list[Any]:
    if not st.items:
        st.waiter = loop.create_future()
        await st.waiter
    items = st.items
    st.items = []
    return items


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(obj, ensure_ascii=False).encode(), status=status,
                        content_type="application/json", headers=headers)


def _error_response(err: P.APIError) -> web.Response:
    resp = _json(err.body(), err.status, err.headers or None)
    if err.headers.get("Connection") == "close":
        resp.force_close()
    return resp


class OpenAIServer:
    def __init__(self, engine: EngineLike, *, served_model_names: list[str] | None = None,
                 api_key: str | None = None, drain_timeout: float = 30.0,
                 default_max_tokens: int | None = None,
                 edge: EdgeLimits | None = None, cors: CorsPolicy | None = None,
                 tool_parser: str | None = None, allow_runtime_lora: bool = False,
                 generation_defaults: dict[str, Any] | None = None,
                 max_logprobs: int | None = None, log_requests: bool = False,
                 access_log: bool = True, reasoning_parser: str | None = None,
                 max_log_len: int | None = None) -> None:
        """tool_parser: --tool-call-parser, given with --enable-auto-tool-choice (None:
        tool_choice "auto" is refused). allow_runtime_lora: serve the LoRA load / unload
        endpoints (--allow-runtime-lora). generation_defaults: request field -> default
        for requests that leave it unset (--generation-config). log_requests: the
        per-request detail log; access_log: a line per request (access_log.py)."""
        self.generation_defaults = dict(generation_defaults or {})
        self.reasoning_parser = reasoning_parser   # --reasoning-parser (reasoning.py)
        self.log_requests = log_requests
        self.max_log_len = max_log_len   # --max-log-len: of a prompt in the request log
        self.access_log = access_log
        self.engine = engine
        self.allow_runtime_lora = allow_runtime_lora
        self.tool_parser = tool_parser
        self.cors = cors or CorsPolicy()
        self.default_max_tokens = default_max_tokens
        self.model_names = list(served_model_names or [engine.model_name])
        self.default_model = self.model_names[0]
        self.api_key = api_key.encode() if api_key else None
        self.drain_timeout = drain_timeout
        self.edge = edge or EdgeLimits()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        per_token = engine.tokenizer.max_chars_per_token
        self.schemas = P.RequestSchemas(P.Limits(
            self.max_model_len, self.vocab_size,
            per_token * self.max_model_len if per_token else None, tool_parser,
            *(() if max_logprobs is None else (max_logprobs,))))
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS,
                                                thread_name_prefix="zerod-tokenize")
        self.respond_pool = ThreadPoolExecutor(RESPOND_THREADS,
                                               thread_name_prefix="zerod-respond")
        self.lora_pool = ThreadPoolExecutor(1, thread_name_prefix="zerod-lora")
        self.created = P.now()
        self.draining = False
        self.inflight: set[_Req] = set()
        self.router: OutputRouter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ----------------------------------------------------------------- app

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.edge.max_body_bytes,
                              middlewares=[access_middleware(self.access_log, REQUEST_ID),
                                           self._middleware])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.on_response_prepare.append(self._response_headers)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self.router = OutputRouter(self.loop)

    async def _on_cleanup(self, app: web.Application) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.respond_pool.shutdown(wait=False, cancel_futures=True)
        self.lora_pool.shutdown(wait=False, cancel_futures=True)

    async def _response_headers(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Before any answer's headers go out (streams included): its id and CORS."""
        resp.headers["X-Request-Id"] = request.get(REQUEST_ID) or request_id(None)
        origin = request.headers.get("Origin")
        if origin and "Access-Control-Allow-Methods" not in resp.headers:
            resp.headers.update(self.cors.simple(origin))

    def _preflight(self, request: web.Request) -> web.Response:
        status, headers = self.cors.preflight(
            request.headers["Origin"], request.headers["Access-Control-Request-Method"],
            request.headers.get("Access-Control-Request-Headers", ""))
        return web.Response(status=status, headers=headers,
                            text="OK" if status == 200 else "Disallowed CORS request")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        request[REQUEST_ID] = request_id(request.headers.get("X-Request-Id"))
        if (request.method == "OPTIONS" and "Origin" in request.headers
                and "Access-Control-Request-Method" in request.headers):
            return self._preflight(request)  # before auth: browsers send no key on preflight
        try:
            if request.path.startswith("/v1/"):
                if self.api_key is not None:
                    self._check_auth(request)
                if self.draining:
                    raise P.APIError(503, "the server is shutting down and takes no new "
                                     "requests", headers={"Retry-After": "5"})
            return await handler(request)
        except P.APIError as err:
            return _error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = edge_error(exc, self.edge) or P.APIError(exc.status, {
                404: f"no route {request.path}",
                405: f"method {request.method} is not allowed on {request.path}",
            }.get(exc.status, exc.reason))
            if "Allow" in exc.headers:  # a 405 says which methods are
                err.headers["Allow"] = exc.headers["Allow"]
            return _error_response(err)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            err = edge_error(exc, self.edge)  # a malformed body aiohttp found while reading
            if err is not None:
                request.content.feed_eof()  # nothing after a broken body is worth reading
                err.headers["Connection"] = "close"
                return _error_response(err)
            # a bug: answer 500 in the error shape, keep serving
            log.exception("internal error on %s (request %s)", request.path,
                          request[REQUEST_ID])
            return _error_response(P.APIError(500, f"internal server error: {exc}"))

    def _check_auth(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compare bytes.
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self.api_key)
        if not ok:
            raise P.APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                             "<key>'", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    # ----------------------------------------------------------------- simple endpoints

    async def models(self, request: web.Request) -> web.Response:
        adapters = [(a.name, a.path, a.base_model_name) for a in self._adapters()]
        return _json(P.models_response(self.model_names, self.max_model_len,
                                       self.engine.model_path, self.created, adapters))

    # ----------------------------------------------------------------- LoRA adapters

    def _adapters(self) -> list[Any]:
        """The engine's LoRA adapters now (none for an engine without LoRA)."""
        return self.engine.lora_adapters()

    def _runtime_lora(self, path: str) -> None:
        if not self.allow_runtime_lora:   # vLLM serves no such route without its switch
            raise P.APIError(404, f"{path} is off: start the server with --allow-runtime-lora "
                             "to load and unload LoRA adapters while it runs")

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        from zerod.engine.config import EngineError

        self._runtime_lora(request.path)
        name, path = P.parse_lora_request(await self._body(request), with_path=True)
        if name in self.model_names:
            raise P.bad(f"'{name}' is the base model's name", "lora_name")
        if any(a.name == name for a in self._adapters()):
            raise P.bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:   # reads the adapter's files: off the event loop and off the tokenizer pool
            await asyncio.wait_for(self.loop.run_in_executor(
                self.lora_pool, self.engine.load_lora, name, path), LORA_LOAD_TIMEOUT_S)
        except EngineError as exc:   # LoraError is one: names what is wrong
            raise P.bad(str(exc), "lora_path") from None
        except asyncio.TimeoutError:
            raise P.bad(f"reading the adapter at {path} took more than {LORA_LOAD_TIMEOUT_S} s "
                        "(LORA_LOAD_TIMEOUT_S); it was not loaded", "lora_path") from None
        log.info("LoRA adapter %r loaded from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        self._runtime_lora(request.path)
        name, _ = P.parse_lora_request(await self._body(request), with_path=False)
        try:
            self.engine.unload_lora(name)
        except (KeyError, AttributeError):
            raise P.APIError(404, f"The lora adapter '{name}' cannot be found.",
                             param="lora_name", code="model_not_found") from None
        log.info("LoRA adapter %r unloaded (its requests in flight finish)", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def version(self, request: web.Request) -> web.Response:
        from zerod import __version__

        return _json({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        req = self.schemas.parse_tokenize(await self._body(request))
        self._model(req.model)
        tok = self.engine.tokenizer

        def work() -> list[int]:
            text = req.prompt if req.messages is None else tok.apply_chat_template(
                req.messages, add_generation_prompt=req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=req.add_special_tokens)

        where = "prompt" if req.messages is None else "messages"
        n = len(req.prompt) if req.messages is None else sum(len(m["content"])
                                                              for m in req.messages)
        ids = await self._tokenizer_work(work, n, where)
        strs = [tok.decode([i], skip_special_tokens=False) for i in ids] \
            if req.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                      "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        model, ids = self.schemas.parse_detokenize(await self._body(request))
        self._model(model)
        return _json({"prompt": self.engine.tokenizer.decode(ids)})

    async def openapi(self, request: web.Request) -> web.Response:
        return _json(openapi_document(self.schemas, self.model_names, self.allow_runtime_lora))

    def _stats(self) -> dict[str, Any]:
        try:
            return dataclasses.asdict(self.engine.stats())
        except Exception as exc:  # a broken engine is unhealthy, not a 500
            return {"healthy": False, "error": str(exc)}

    async def health(self, request: web.Request) -> web.Response:
        stats = self._stats()
        healthy = bool(stats.get("healthy", False))
        status = "draining" if self.draining else ("ok" if healthy else "unhealthy")
        body = {"status": status, "pid": os.getpid(), "model": self.default_model,
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "inflight": len(self.inflight),
                # OS thread ids by Python thread name: lets `zerod bench` attribute the
                # CPU it reads from /proc/PID/task/TID to the step loop, poller, HTTP loop
                "threads": {t.name: t.native_id for t in threading.enumerate()
                            if t.native_id is not None}}
        for k, v in stats.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                body.setdefault(k, v)
        body["last_step"] = stats.get("last_step")   # the daemon's EngineStalled evidence
        if stats.get("engine_threads"):   # an engine in its own process (engine_pid): its threads
            body["engine_threads"] = stats["engine_threads"]
        else:   # the engine in this process: /health as it always was
            body.pop("engine_pid", None)
            body.pop("engine_threads", None)
        body["lora_adapters"] = [a.name for a in self._adapters()]   # the daemon shows them (zerod top)
        return _json(body, 200 if status == "ok" else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        data = await self.loop.run_in_executor(self.respond_pool, self.engine.metrics_text)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ----------------------------------------------------------------- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        req = self.schemas.parse_completion(body)
        apply_defaults(req, body, self.generation_defaults)
        return await self._generate(request, req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        req = self.schemas.parse_chat(body)
        apply_defaults(req, body, self.generation_defaults)
        return await self._generate(request, req)

    async def _body(self, request: web.Request) -> Any:
        limit = self.edge.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise P.APIError(413, f"the request body is larger than {limit} bytes",
                             code="request_too_large", headers={"Connection": "close"})
        try:
            async with asyncio.timeout(self.edge.body_timeout):
                raw = await request.read()
        except TimeoutError:
            request.content.feed_eof()  # close now: no lingering on a slow client's body
            raise P.APIError(408, f"the request body did not arrive within "
                             f"{self.edge.body_timeout:g} s", headers={"Connection": "close"}
                             ) from None
        return P.parse_body(raw)

    def _model(self, name: str | None) -> str:
        """The served name or LoRA adapter a request names (None: the default model)."""
        if name is None or name in self.model_names:
            return name or self.default_model
        adapters = [a.name for a in self._adapters()]
        if name in adapters:
            return name
        raise P.APIError(404, f"The model `{P.shown(name)}` does not exist. This server serves: "
                         f"{', '.join(self.model_names + adapters)}", param="model",
                         code="model_not_found")

    async def _prompt_ids(self, req: P.CompletionRequest, prompt: str | list[int] | None = None
                          ) -> list[int]:
        """The ids of the chat messages, or of `prompt` (completions; default the first)."""
        if prompt is None:
            prompt = req.prompt_ids if req.prompt_ids is not None else req.prompt_text
        if isinstance(prompt, list):
            return prompt  # ids already checked against the vocabulary
        tok = self.engine.tokenizer
        if req.kind == "chat":
            def work() -> list[int]:
                text = tok.apply_chat_template(req.messages,
                                               add_generation_prompt=req.add_generation_prompt,
                                               tools=req.tools, **req.chat_template_kwargs)
                if req.continue_final_message:  # as transformers: cut after the last content
                    last = req.messages[-1]["content"]
                    cut = text.rfind(last) if last else -1
                    if last and cut < 0:
                        raise ValueError("the chat template does not keep the final message "
                                         "as it is, so it cannot be continued")
                    text = text[:cut + len(last)] if last else text
                return tok.encode(text, add_special_tokens=False)
            n = sum(len(m["content"]) for m in req.messages)
        else:
            def work() -> list[int]:
                return tok.encode(prompt, add_special_tokens=True)
            n = len(prompt)
        ids = await self._tokenizer_work(work, n, req.prompt_field)
        if not ids:
            raise P.bad("the prompt is empty after tokenization", req.prompt_field)
        return ids

    async def _tokenizer_work(self, work: Callable[[], list[int]], chars: int,
                              where: str) -> list[int]:
        """Run a tokenizing job (inline when short, else on the pool); its errors are
        the request's fault (a template that refuses these messages): a 400."""
        try:
            if chars > TOKENIZE_INLINE_CHARS:
                return await self.loop.run_in_executor(self.tokenize_pool, work)
            return work()
        except Exception as exc:
            raise P.bad(f"could not tokenize the {where}: {exc}", where) from None

    async def _compile_grammar(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of a structured-output request, compiled on the tokenize
        pool (a large schema takes tens of ms; xgrammar caches what it compiled)."""
        def work() -> Any:
            compiler = self.engine.grammar_compiler
            if compiler is None:
                raise P.bad(f"'{spec.param}' is not supported by this server: this engine has no "
                            "structured outputs", spec.param, "unsupported")
            return compiler.compile(spec)
        try:
            return await self.loop.run_in_executor(self.tokenize_pool, work)
        except GrammarError as exc:
            raise P.bad(f"'{spec.param}': {exc}", spec.param) from None

    async def _generate(self, request: web.Request, req: P.CompletionRequest
                        ) -> web.StreamResponse:
        model = self._model(req.model)
        if self.reasoning_parser and req.kind == "chat":
            refuse_with_reasoning(req)
        prompts = [await self._prompt_ids(req, p) for p in req.prompts] if req.prompts \
            else [await self._prompt_ids(req)]
        plan = _Choices(req, prompts, self.max_model_len, self.default_max_tokens,
                        self.engine.tokenizer)
        if self.reasoning_parser and req.kind == "chat":   # one prompt: its tail says
            plan.thinking_closed = prompt_closes_thinking(self.engine.tokenizer.decode(
                prompts[0][-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        if req.grammar is not None:   # compiled once; each engine request gets its own matcher
            grammar = await self._compile_grammar(req.grammar)
            # with a reasoning parser the grammar constrains the answer after the
            # reasoning (the whole output where the prompt closed the thinking)
            after = (self.reasoning_parser if self.reasoning_parser and req.kind == "chat"
                     and not plan.thinking_closed else None)
            for _, params, _ in plan.choices:
                params.grammar, params.reasoning_parser = grammar, after
        if request.headers.get(CANARY_HEADER) == "1":   # the daemon's canary: not in the metrics
            for _, params, _ in plan.choices:
                params.unmetered = True
        tally = request[TALLY]
        tally.model, tally.prompt_tokens = model, plan.prompt_tokens
        if self.log_requests:
            log_request(request[REQUEST_ID], req, req.prompts or [req.prompt_text],
                        plan.choices[0][1], self.max_log_len)
        st = _Req()
        st.rid = []
        self.inflight.add(st)
        try:
            await self._submit(request, plan, st, None if model in self.model_names else model)
            if req.stream and req.kind == "chat" and (req.tool_choice != "none"
                                                      or self.reasoning_parser):
                return await self._stream_tools(request, req, st, model, plan)
            if req.stream:
                return await self._stream(request, req, st, model, plan)
            return await self._collect(req, st, model, plan)
        finally:
            self.inflight.discard(st)
            if not st.finished:
                self._abort(st)

    async def _submit(self, request: web.Request, plan: _Choices, st: _Req, lora: str | None) -> None:
        """Queue every choice's engine request (a sibling of n > 1 after its first, so it
        shares the prompt's KV pages), with LoRA adapter `lora` if not None; a refusal
        aborts those already queued. An engine in another process answers each submit
        with a Future: awaited, so a refusal is still this request's status."""
        multi = len(plan.choices) > 1
        kw = {"lora": lora} if lora is not None else {}
        try:
            for i, (ids, params, lead) in enumerate(plan.choices):
                cb = request[TALLY].counting(i, self.router.callback(st, i if multi else None))
                after = {} if lead is None else {"after": st.rid[lead]}
                rid = self.engine.submit(ids, params, cb, **kw, **after)
                if isinstance(rid, SubmitFuture):
                    st.rid.append(rid.request_id)   # abort takes it while the answer comes
                    await asyncio.wrap_future(rid)
                else:
                    st.rid.append(rid)
            log.debug("request %s is engine request(s) %s", request[REQUEST_ID], st.rid)
        except RequestRejected as exc:
            self._abort(st)
            headers = {}
            if exc.status in (429, 503):
                ra = exc.retry_after if exc.retry_after is not None else 1
                headers["Retry-After"] = str(max(1, int(-(-float(ra) // 1))))
            raise P.APIError(int(exc.status), exc.message, headers=headers,
                             code={429: "rate_limit_exceeded", 404: "model_not_found"}.get(exc.status)
                             ) from None

    def _abort(self, st: _Req) -> None:
        for rid in st.rid:
            try:
                self.engine.abort(rid)
            except Exception:  # abort is idempotent; never mask the real outcome
                log.exception("abort(%s) failed", rid)

    def _tok_str(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _tok_namer(self, req: P.CompletionRequest) -> Callable[[int], str]:
        """How a request's logprobs name tokens: by their text, or (vLLM's
        return_tokens_as_token_ids) "token_id:N", where ids that decode alike stay apart."""
        return _token_id_str if req.return_tokens_as_token_ids else self._tok_str

    async def _collect(self, req: P.CompletionRequest, st: _Req, model: str,
                       plan: _Choices) -> web.Response:
        loop = self.loop
        n = len(plan.choices)
        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list] = [[] for _ in range(n)]
        plps: list[list] = [[] for _ in range(n)]    # prompt logprobs (asked for)
        done: list[str | None] = [None] * n
        tokens = [0] * n
        cached = [0] * n
        left = n
        while left:
            for item in await _next_items(st, loop):
                if item is _ABORTED:
                    done = [d or "abort" for d in done]
                    left = 0
                    break
                i, out = item if n > 1 else (0, item)
                if out.text:
                    texts[i].append(out.text)
                if out.logprobs:
                    lps[i] += out.logprobs
                if out.prompt_logprobs:
                    plps[i] = out.prompt_logprobs
                tokens[i] = out.completion_tokens
                if out.finished and done[i] is None:
                    done[i] = out.finish_reason
                    cached[i] = out.cached_tokens
                    if out.finish_reason == "error":
                        st.error = out.error
                    left -= 1
        st.finished = True
        if "error" in done:
            raise P.APIError(500, st.error or "the engine failed while generating this "
                             "request", code="engine_error")

        def build() -> bytes:   # a response pool thread: the loop keeps serving meanwhile
            return encode_sliced(self._answer(req, model, plan, texts, lps, plps, done,
                                              tokens, cached))

        body = await loop.run_in_executor(self.respond_pool, build)
        return web.Response(body=body, content_type="application/json")

    def _answer(self, req: P.CompletionRequest, model: str, plan: _Choices,
                texts: list[list[str]], lps: list[list], plps: list[list],
                done: list[str | None], tokens: list[int], cached: list[int]) -> dict[str, Any]:
        """The non-streamed answer object of a collected request."""
        n = len(plan.choices)
        choices = []
        tok_str = self._tok_namer(req)
        shown = [P.prompt_logprobs_json(e, tok_str, req.prompt_logprobs)
                 if req.show_prompt_logprobs else None for e in plps]
        for i in range(n):
            text = "".join(texts[i])
            echo = plan.echo_text(i)
            if req.kind == "chat":
                lp = P.chat_logprobs(lps[i], tok_str) if req.logprobs is not None else None
                thought = None
                if self.reasoning_parser:   # tools are read from the answer alone
                    split = split_reasoning(self.reasoning_parser, text, plan.thinking_closed)
                    thought, text = split.reasoning, split.content or ""
                if self.reasoning_parser and not text:   # all reasoning: no answer, no call
                    content, calls, finish = None, [], done[i]
                else:
                    content, calls, finish = outcome(req.tool_choice, req.tool_name,
                                                     self.tool_parser, text, done[i], req.tools)
                if self.reasoning_parser and not content:
                    content = None   # no answer text (as vLLM)
                choice = P.chat_choice(i, content, finish, lp, [c.to_openai() for c in calls])
                if self.reasoning_parser:   # both names: vLLM's older and newer
                    choice["message"]["reasoning_content"] = thought
                    choice["message"]["reasoning"] = thought
                choices.append(choice)
            else:
                # echo with logprobs: the prompt tokens' entries first, offsets from 0
                lp = (P.completion_logprobs((plps[i] if echo else []) + lps[i], tok_str,
                                            top_n=req.logprobs)
                      if req.logprobs is not None else None)
                choices.append(P.completion_choice(i, echo + text, done[i], lp, shown[i]))
        u = P.usage(plan.prompt_tokens, sum(tokens), sum(cached))
        if req.kind == "chat":   # one prompt: its prompt logprobs at the top, as vLLM
            return P.chat_response(P.new_id("chat"), P.now(), model, choices, u, shown[0])
        return P.completion_response(P.new_id(req.kind), P.now(), model, choices, u)

    async def _stream(self, request: web.Request, req: P.CompletionRequest, st: _Req,
                      model: str, plan: _Choices) -> web.StreamResponse:
        loop = self.loop
        enc = P.ChunkEncoder(req.kind, P.new_id(req.kind), P.now(), model, req.include_usage)
        general = len(plan.choices) > 1 or req.logprobs is not None or req.echo
        fmt = (_ChoicesFormatter(enc, req, plan, self._tok_namer(req)) if general
               else _SSEFormatter(enc, req.include_usage, plan.prompt_tokens))
        first = fmt.head() if general else enc.role() if req.kind == "chat" else b""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunked = "chunked" in resp.headers.get("Transfer-Encoding", "").lower()
        try:
            if request.writer.output_size == 0:
                # This aiohttp holds the headers back until the first write: that one goes
                # through aiohttp, which sends them with it ...
                items = await _next_items(st, loop)
                data = fmt(items, first)
                st.finished = fmt.finished
                await resp.write(data)
                head = b""
            else:
                # ... else the headers are out and every chunk, the first included, is
                # written by the drain callback itself (the first token reaches the client
                # without a wake-up of this handler; docs/perf.md "Request path")
                head = first
            if not st.finished:
                # The drain callback writes straight to the transport (chunk-framed as
                # aiohttp would): no task wake-up and no coroutine per token; this handler
                # only waits for the end.
                done = loop.create_future()
                st.sink = _DirectSink(st, fmt, request.transport, chunked, done, head)
                if st.items:  # arrived while the first write was in flight
                    st.sink()
                if not await done:
                    return resp  # the client is gone; _generate's finally aborts
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away; the finally of _generate aborts the request
        return resp

    async def _stream_tools(self, request: web.Request, req: P.CompletionRequest, st: _Req,
                            model: str, plan: _Choices) -> web.StreamResponse:
        """A streamed chat request with tools or a reasoning parser, in OpenAI's delta
        shape, each choice's chunks under its own index: chat_stream.ChoiceStream says
        what each piece of output becomes (reasoning, content, tool-call deltas)."""
        enc = P.ChunkEncoder("chat", P.new_id("chat"), P.now(), model, req.include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = len(plan.choices)
        streams = [ChoiceStream(req.tool_choice, req.tool_name, self.tool_parser, req.tools,
                                self.reasoning_parser, plan.thinking_closed) for _ in range(n)]
        done: list[str | None] = [None] * n
        tokens = [0] * n
        cached = [0] * n
        error = None
        try:
            for i in range(n):
                await resp.write(enc.choice(i, "", None, role=True))
            while error is None and None in done:
                for item in await _next_items(st, self.loop):
                    if item is _ABORTED:
                        for i in range(n):
                            if done[i] is None:
                                done[i] = "abort"
                                await resp.write(_choice_end(enc, streams[i], i, "abort"))
                        break
                    i, out = item if n > 1 else (0, item)
                    tokens[i] = out.completion_tokens
                    if out.text:
                        deltas = streams[i].feed(out.text)
                        if deltas:
                            await resp.write(b"".join(enc.delta(d, index=i) for d in deltas))
                    if out.finished and done[i] is None:
                        done[i], cached[i] = out.finish_reason, out.cached_tokens
                        if out.finish_reason == "error":
                            error = out.error or "the engine failed while generating this request"
                            break
                        await resp.write(_choice_end(enc, streams[i], i, out.finish_reason))
            # an error ends the stream: _generate's finally aborts the choices still running
            st.finished = None not in done
            if error is not None:
                await resp.write(P.sse(P.error_body(error, "server_error", None, "engine_error")))
            if req.include_usage:
                await resp.write(enc.usage(plan.prompt_tokens, sum(tokens), sum(cached)))
            await resp.write(P.DONE)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away; the finally of _generate aborts the request
        return resp

    # ----------------------------------------------------------------- drain

    async def drain(self, timeout: float | None = None) -> None:
        """Stop admitting; let in-flight requests end within `timeout`; end the rest."""
        self.draining = True
        timeout = self.drain_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.inflight)
        if left:
            log.warning("drain timeout: ending %d in-flight request(s)", len(left))
        for st in left:
            self._abort(st)
            # the marker ends the stream after any items still queued before it
            _push_end(st)
        t_end = time.monotonic() + 2.0
        while self.inflight and time.monotonic() < t_end:
            await asyncio.sleep(0.02)


def _choice_end(enc: P.ChunkEncoder, stream: ChoiceStream, index: int,
                finish: str | None) -> bytes:
    """The last chunks of one choice: what its stream held, then its finish reason."""
    deltas, finish = stream.end(finish)
    return b"".join([*(enc.delta(d, index=index) for d in deltas),
                     enc.delta({}, finish, index=index)])


def _token_id_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def refuse_with_reasoning(req: P.CompletionRequest) -> None:
    """What --reasoning-parser cannot serve, refused by name: streamed chat logprobs (the
    stream's deltas are the split text, reasoning and answer, and carry no token entries,
    as with streamed tool calls)."""
    if req.stream and req.logprobs is not None:
        raise P.bad("'logprobs' with stream: true is not served with --reasoning-parser",
                    "logprobs", "unsupported")


class _SSEFormatter:
    """Engine outputs -> the SSE bytes of one stream (state: counts, finished)."""

    __slots__ = ("cached_tokens", "completion_tokens", "enc", "finished", "include_usage",
                 "prompt_len")

    def __init__(self, enc: P.ChunkEncoder, include_usage: bool, prompt_len: int) -> None:
        self.enc = enc
        self.include_usage = include_usage
        self.prompt_len = prompt_len
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False

    def __call__(self, items: list[Any], head: bytes = b"") -> bytes:
        enc = self.enc
        content = enc.content
        parts = [head] if head else []
        for out in items:
            if out is _ABORTED:
                self.finished = True
                parts.append(enc.finish("abort"))
                break
            self.completion_tokens = out.completion_tokens
            if out.finished:
                self.finished = True
                fr = out.finish_reason
                self.prompt_len = out.prompt_tokens or self.prompt_len
                self.cached_tokens = out.cached_tokens
                if fr == "error":
                    if out.text:
                        parts.append(content(out.text))
                    parts.append(P.sse(P.error_body(
                        out.error or "the engine failed while generating this request",
                        "server_error", None, "engine_error")))
                elif out.text:
                    parts.append(content(out.text, fr))
                else:
                    parts.append(enc.finish(fr))
                break
            if out.text or out.token_ids:
                parts.append(content(out.text))
        if self.finished:
            if self.include_usage:
                parts.append(enc.usage(self.prompt_len, self.completion_tokens, self.cached_tokens))
            parts.append(P.DONE)
        return b"".join(parts)


class _Choices:
    """The engine requests one API request makes: each prompt x n, in choice order
    (choice index = prompt index x n + sibling), with its prompt ids and params."""

    def __init__(self, req: P.CompletionRequest, prompts: list[list[int]], max_model_len: int,
                 default_max_tokens: int | None, tokenizer: Any) -> None:
        self.prompts = prompts
        self.thinking_closed = False   # a chat prompt that closed the thinking (reasoning.py)
        # echo: each prompt as text (token-id prompts decoded)
        self.echoes = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
                       for p in req.prompts] if req.echo else []
        self.n = req.n
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.choices: list[tuple[list[int], Any, int | None]] = []   # (ids, params, lead choice)
        settled: list[int] = []
        for ids in prompts:
            max_tokens = P.check_context(req, len(ids), max_model_len, default_max_tokens)
            settled.append(max_tokens)
            params = P.sampling_params(req, max_tokens)
            first = len(self.choices)
            for j in range(req.n):
                # as vLLM: sibling j of a seeded request samples with seed + j
                p = params if j == 0 or req.seed is None else dataclasses.replace(params, seed=req.seed + j)
                self.choices.append((ids, p, None if j == 0 else first))
        # the whole request's answer is bounded, not each prompt's
        P.check_prompt_logprobs(req, self.prompt_tokens * req.n, len(self.choices))
        check_response_size(req, [len(p) for p in prompts], settled)

    def echo_text(self, index: int) -> str:
        """The prompt of choice `index` as text, when echo is on ("" otherwise)."""
        return self.echoes[index // self.n] if self.echoes else ""


class _ChoicesFormatter:
    """Engine outputs -> SSE bytes for the general streams: several choices (outputs
    come as (index, output)), logprobs, echo. Each chunk carries one choice."""

    __slots__ = ("cached", "echo", "echo_due", "enc", "finished", "include_usage", "left",
                 "logprobs", "offsets", "open", "plan", "tok_str", "tokens", "top_n")

    def __init__(self, enc: P.ChunkEncoder, req: P.CompletionRequest, plan: _Choices,
                 tok_str: Callable[[int], str]) -> None:
        self.enc, self.plan, self.tok_str = enc, plan, tok_str
        self.include_usage = req.include_usage
        self.logprobs = req.logprobs is not None
        self.top_n = req.logprobs
        self.echo = req.echo
        n = len(plan.choices)
        self.left = n
        self.open = [True] * n      # choices not finished yet
        self.tokens = [0] * n
        self.cached = [0] * n
        self.offsets = [0] * n      # completions: text_offset of each choice's next token
        # echo with logprobs: a choice's prompt chunk waits for its prompt logprobs, which
        # come with its first output
        self.echo_due = [self.echo and self.logprobs] * n
        self.finished = False

    def head(self) -> bytes:
        """Chat: a role chunk per choice; completions with echo: each choice's prompt."""
        enc, n = self.enc, len(self.plan.choices)
        if enc.kind == "chat":
            return b"".join(enc.choice(i, "", None, role=True) for i in range(n))
        if not self.echo or self.logprobs:
            return b""
        return b"".join(enc.choice(i, self.plan.echo_text(i), None) for i in range(n))

    def _echo(self, i: int, prompt_lps: list | None) -> bytes:
        """Choice i's prompt chunk with its prompt tokens' logprobs (text_offset from 0)."""
        self.echo_due[i] = False
        lp = None
        if prompt_lps:
            lp = P.completion_logprobs(prompt_lps, self.tok_str, 0, self.top_n)
            self.offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return self.enc.choice(i, self.plan.echo_text(i), None, lp)

    def _lp(self, i: int, entries: list | None) -> dict[str, Any] | None:
        if not self.logprobs or not entries:
            return None
        if self.enc.kind == "chat":
            return P.chat_logprobs(entries, self.tok_str)
        lp = P.completion_logprobs(entries, self.tok_str, self.offsets[i])
        self.offsets[i] += sum(len(t) for t in lp["tokens"])
        return lp

    def __call__(self, items: list[Any], head: bytes = b"") -> bytes:
        enc = self.enc
        multi = len(self.plan.choices) > 1
        parts = [head] if head else []
        for item in items:
            if item is _ABORTED:
                parts += [enc.choice(i, None if enc.kind == "chat" else "", "abort")
                          for i, o in enumerate(self.open) if o]
                self.left = 0
                break
            i, out = item if multi else (0, item)
            self.tokens[i] = out.completion_tokens
            if self.echo_due[i]:
                parts.append(self._echo(i, out.prompt_logprobs))
            if out.finished:
                self.open[i] = False
                self.cached[i] = out.cached_tokens
                self.left -= 1
                if out.finish_reason == "error":
                    parts.append(P.sse(P.error_body(
                        out.error or "the engine failed while generating this request",
                        "server_error", None, "engine_error")))
                    self.left = 0
                    break
                text = out.text if out.text or enc.kind != "chat" else None
                parts.append(enc.choice(i, text, out.finish_reason, self._lp(i, out.logprobs)))
            elif out.text or out.token_ids:
                parts.append(enc.choice(i, out.text, None, self._lp(i, out.logprobs)))
        if self.left == 0:
            self.finished = True
            if self.include_usage:
                parts.append(enc.usage(self.plan.prompt_tokens, sum(self.tokens), sum(self.cached)))
            parts.append(P.DONE)
        return b"".join(parts)


class _DirectSink:
    """Writes a stream's pending outputs from the drain callback, synchronously.

    Chunked framing as aiohttp writes it (`%x\\r\\n` data `\\r\\n`); HTTP/1.0 clients get
    the raw bytes (their body ends when the connection closes). No flow control beyond
    the transport's buffer: a stream's total output is bounded by max_tokens.
    """

    __slots__ = ("chunked", "done", "fmt", "head", "st", "transport")

    def __init__(self, st: _Req, fmt: _SSEFormatter | _ChoicesFormatter, transport: Any,
                 chunked: bool, done: asyncio.Future, head: bytes = b"") -> None:
        self.st, self.fmt, self.transport, self.chunked, self.done = (
            st, fmt, transport, chunked, done)
        self.head = head   # what the stream's first chunk starts with (sent once)

    def __call__(self) -> None:
        st = self.st
        items = st.items
        st.items = []
        if self.done.done():
            return
        data = self.fmt(items, self.head)
        self.head = b""
        st.finished = self.fmt.finished
        t = self.transport
        if t is None or t.is_closing():
            st.sink = None
            self.done.set_result(False)
            return
        if data:
            t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if st.finished:
            self.done.set_result(True)


def _push_end(st: _Req) -> None:
    st.items.append(_ABORTED)
    if st.sink is not None:
        st.sink()
        return
    w = st.waiter
    if w is not None:
        st.waiter = None
        if not w.done():
            w.set_result(None)


# --------------------------------------------------------------------------- running it


async def _start(server: OpenAIServer, sock: socket.socket) -> EdgeRunner:
    """Serve `server` on `sock` (bound by http_edge.bind_socket; listening starts here)."""
    app = server.make_app()
    # We drain in-flight requests ourselves first; what is left after that (a client that
    # stopped reading) gets 2 s, not aiohttp's default 60 s, before its handler is cancelled.
    runner = EdgeRunner(app, server.edge, handler_cancellation=True, access_log=None,
                        shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=2048).start()
    FIRST_USES.mark_ready()   # serving from here: what is built or imported later, a request paid
    return runner


async def serve_async(engine: EngineLike, sock: socket.socket, *, served_model_names=None,
                      api_key: str | None = None, drain_timeout: float = 30.0,
                      default_max_tokens: int | None = None,
                      edge: EdgeLimits | None = None, cors: CorsPolicy | None = None,
                      on_ready: Callable[[int], None] | None = None,
                      stop_event: asyncio.Event | None = None,
                      handle_signals: bool = True,
                      tool_parser: str | None = None, allow_runtime_lora: bool = False,
                      on_stop: Callable[[], None] | None = None, **options: Any) -> None:
    """on_stop: called once the stop comes, before the drain (the HTTP server processes
    beside this one are told then). options: OpenAIServer's other keywords
    (generation_defaults, max_logprobs, log_requests, access_log)."""
    server = OpenAIServer(engine, served_model_names=served_model_names, api_key=api_key,
                          drain_timeout=drain_timeout, default_max_tokens=default_max_tokens,
                          edge=edge, cors=cors, tool_parser=tool_parser,
                          allow_runtime_lora=allow_runtime_lora, **options)
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runner = await _start(server, sock)
    if on_ready:
        on_ready(sock.getsockname()[1])
    try:
        await stop.wait()
        if on_stop is not None:
            on_stop()
        log.info("stopping: draining up to %.1fs", drain_timeout)
        await server.drain(drain_timeout)
    finally:
        await runner.cleanup()


class ServerThread:
    """The server on its own event loop in a thread (tests, embedding)."""

    def __init__(self, engine: EngineLike, host: str = "127.0.0.1", port: int = 0,
                 **kw: Any) -> None:
        self.engine = engine
        self.host = host
        self.kw = kw
        self.port = port
        self.server: OpenAIServer | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zerod-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.server = OpenAIServer(self.engine, **self.kw)
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        runner = await _start(self.server, sock)
        self._ready.set()
        try:
            await self._stop.wait()
            await self.server.drain()
        finally:
            await runner.cleanup()

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop and self._stop and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
