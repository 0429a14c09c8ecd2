"""OpenAI wire protocol: request validation, response and chunk shapes, error JSON.

Pure Python (no torch, no aiohttp): `server.py` calls these. Validation turns a
decoded JSON body into a `CompletionRequest` (prompt still as text, ids or chat
messages; sampling fields checked for type and range) or raises `APIError`
with the status and OpenAI's error shape. Unknown fields are ignored; a known
field of the wrong type or out of range is a 400 naming the field (`param`).

Streaming is the hot path (200 streams x ~100 tokens/s each on the GPU), so a
`ChunkEncoder` pre-encodes each request's constant JSON around the content and
a token costs one `json.dumps` of its text and two byte concatenations.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --------------------------------------------------------------------------- the request


@dataclass
class CompletionRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt_text: str | None = None  # completions, text prompt
    prompt_ids: list[int] | None = None  # completions, token-id prompt
    messages: list[dict[str, Any]] | None = None  # chat
    add_generation_prompt: bool = True
    max_tokens: int | None = None  # None: what the context leaves (chat) / 16 (completions)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    # which sampling fields the client set explicitly (others keep the engine's defaults)
    explicit: set[str] = field(default_factory=set)


# OpenAI's documented default for /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Largest max_tokens accepted before the context check (guards int overflow in the engine).
MAX_TOKENS_LIMIT = 1 << 31


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None,
             nullable: bool = True) -> int | None:
    v = body.get(name)
    if v is None:
        if not nullable and name in body:
            raise bad(f"'{name}' must be an integer, not null", name)
        return None
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}: {v!r:.50}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _get_num(body: dict, name: str, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}: {v!r:.50}", name)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return float(v)


def _get_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {type(v).__name__}: {v!r:.50}", name)
    return v


def _get_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(f"'{name}' must be a string, got {type(v).__name__}", name)
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise bad(f"'{name}' must be a list of integers", name)
    if any(x < 0 for x in v):
        raise bad(f"'{name}' must not hold negative token ids", name)
    return v


def _unsupported_if(cond: bool, name: str, what: str) -> None:
    if cond:
        raise bad(f"'{name}' is not supported by this server: {what}", name, "unsupported")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON request body into a dict or raise a 400."""
    if not raw:
        raise bad("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _common(body: dict, req: CompletionRequest) -> None:
    """Fields shared by both endpoints."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    req.model = model

    n = _get_int(body, "n", lo=1)
    _unsupported_if(n is not None and n != 1, "n", "only n=1 (one choice per request)")
    best_of = _get_int(body, "best_of", lo=1)
    _unsupported_if(best_of is not None and best_of != 1, "best_of", "only best_of=1")

    stream = _get_bool(body, "stream")
    req.stream = bool(stream)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad("'stream_options.include_usage' must be a boolean",
                      "stream_options.include_usage")
        if not req.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        req.include_usage = bool(iu)

    t = _get_num(body, "temperature", lo=0.0, hi=2.0)
    if t is not None:
        req.temperature = t
        req.explicit.add("temperature")
    p = _get_num(body, "top_p", lo=0.0, hi=1.0, lo_open=True)
    if p is not None:
        req.top_p = p
        req.explicit.add("top_p")
    k = _get_int(body, "top_k", lo=-1)
    if k is not None:
        req.top_k = 0 if k == -1 else k
        req.explicit.add("top_k")
    mt = _get_int(body, "min_tokens", lo=0)
    if mt is not None:
        req.min_tokens = mt
        req.explicit.add("min_tokens")
    seed = _get_int(body, "seed")
    if seed is not None:
        req.seed = seed
        req.explicit.add("seed")

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if any(s == "" for s in stop):
            raise bad("'stop' must not contain empty strings", "stop")
        req.stop = stop
        if stop:
            req.explicit.add("stop")
    sti = body.get("stop_token_ids")
    if sti is not None:
        req.stop_token_ids = _int_list(sti, "stop_token_ids")
        if sti:
            req.explicit.add("stop_token_ids")
    ie = _get_bool(body, "ignore_eos")
    if ie is not None:
        req.ignore_eos = ie
        if ie:
            req.explicit.add("ignore_eos")

    # Accepted at their neutral value, refused otherwise (silently ignoring them would
    # hand the client something other than what it asked for).
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        v = _get_num(body, name)
        _unsupported_if(v is not None and v != neutral, name, f"only {neutral}")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise bad("'logit_bias' must be an object", "logit_bias")
    _unsupported_if(bool(lb), "logit_bias", "no logit bias")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user")


def _max_tokens(body: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = _get_int(body, name, lo=1, hi=MAX_TOKENS_LIMIT)
        if v is not None:
            return v
    return None


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body."""
    req = CompletionRequest(kind="completion", model=None)
    _common(body, req)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt")
    prompt = body["prompt"]
    # A list of one prompt (text or ids) is unwrapped; batches of several are refused.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _unsupported_if(len(prompt) != 1, "prompt",
                        f"one prompt per request (got a batch of {len(prompt)})")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise bad("'prompt' must not be empty", "prompt")
        req.prompt_text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        req.prompt_ids = _int_list(prompt, "prompt")
    else:
        raise bad("'prompt' must be a string, a list of token ids, or a list of one of those",
                  "prompt")
    req.max_tokens = _max_tokens(body, ("max_tokens",))
    if req.max_tokens is None and "max_tokens" not in body:
        req.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's default
    # an explicit null means: what the context leaves
    echo = _get_bool(body, "echo")
    _unsupported_if(bool(echo), "echo", "echo of the prompt")
    lp = body.get("logprobs")
    if lp is not None and not _is_int(lp):
        raise bad("'logprobs' must be an integer or null", "logprobs")
    _unsupported_if(lp is not None and lp > 0, "logprobs", "log probabilities")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad("'suffix' must be a string", "suffix")
    _unsupported_if(bool(suffix), "suffix", "insertion with a suffix")
    return req


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _message_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"messages[{i}].content parts must be objects with a 'type'",
                          f"messages[{i}].content")
            if part["type"] != "text":
                raise bad(f"messages[{i}].content part of type {part['type']!r} is not "
                          "supported by this server (text only)", f"messages[{i}].content",
                          "unsupported")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content text part needs a string 'text'",
                          f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of content parts",
              f"messages[{i}].content")


def parse_chat(body: dict[str, Any]) -> CompletionRequest:
    """Validate a /v1/chat/completions body."""
    req = CompletionRequest(kind="chat", model=None)
    _common(body, req)
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of messages", "messages")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    clean: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r:.40}",
                      f"messages[{i}].role")
        msg = {"role": role, "content": _message_content(m.get("content"), i)}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
            msg["name"] = name
        clean.append(msg)
    req.messages = clean
    req.max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    agp = _get_bool(body, "add_generation_prompt")
    if agp is not None:
        req.add_generation_prompt = agp
    lp = _get_bool(body, "logprobs")
    _unsupported_if(bool(lp), "logprobs", "log probabilities")
    tl = body.get("top_logprobs")
    if tl is not None and not _is_int(tl):
        raise bad("'top_logprobs' must be an integer", "top_logprobs")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    _unsupported_if(bool(tools), "tools", "tool calling")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad("'response_format' must be an object with a 'type'", "response_format")
        _unsupported_if(rf["type"] != "text", "response_format",
                        f"only type 'text' (got {rf['type']!r:.40})")
    return req


def check_context(req: CompletionRequest, prompt_len: int, max_model_len: int,
                  default_max_tokens: int | None = None) -> int:
    """Settle max_tokens against the context; return it or raise a 400 (vLLM's wording).

    A request without max_tokens gets what the context leaves, capped by
    `default_max_tokens` when the server sets one (the engine reserves KV pages for
    prompt + max_tokens at admission, so "the whole context" is a large reservation)."""
    where = "messages" if req.kind == "chat" else "prompt"
    if prompt_len >= max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, "
                  f"your {where} has {prompt_len} tokens, which leaves no room for output. "
                  "Please reduce the length of the "
                  f"{where}.", "messages" if req.kind == "chat" else "prompt",
                  "context_length_exceeded")
    if req.max_tokens is None:
        left = max_model_len - prompt_len
        return min(left, default_max_tokens) if default_max_tokens else left
    if prompt_len + req.max_tokens > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, "
                  f"you requested {prompt_len + req.max_tokens} tokens ({prompt_len} in the "
                  f"{where}, {req.max_tokens} in the completion). Please reduce the length of "
                  f"the {where} or the completion.", "max_tokens", "context_length_exceeded")
    return req.max_tokens


def sampling_kwargs(req: CompletionRequest, max_tokens: int) -> dict[str, Any]:
    """The SamplingParams keyword arguments for this request."""
    return {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_tokens": req.min_tokens,
        "seed": req.seed,
        "stop": list(req.stop),
        "stop_token_ids": list(req.stop_token_ids),
        "ignore_eos": req.ignore_eos,
    }


_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_tokens": 0, "seed": None,
            "stop": [], "stop_token_ids": [], "ignore_eos": False}


def build_sampling_params(cls: type, req: CompletionRequest, max_tokens: int) -> Any:
    """Build the engine's SamplingParams, passing only fields it has.

    A field the client set to a non-neutral value that the engine's SamplingParams lacks
    is refused (400) rather than silently dropped.
    """
    kwargs = sampling_kwargs(req, max_tokens)
    names = _field_names(cls)
    if names is not None:
        for k in list(kwargs):
            if k not in names:
                v = kwargs.pop(k)
                if k != "max_tokens" and v != _NEUTRAL.get(k):
                    raise bad(f"'{k}' is not supported by this engine", k, "unsupported")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the engine's own validation
        raise bad(str(exc)) from None


def _field_names(cls: type) -> set[str] | None:
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


# --------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(12).hex()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, created: int, model: str, text: str,
                        finish_reason: str | None, prompt_tokens: int,
                        completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def models_response(names: list[str], max_model_len: int, root: str,
                    created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "zerod",
         "root": root, "parent": None, "max_model_len": max_model_len}
        for n in names]}


DONE = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# Characters JSON must escape in a string; text without them is quoted as is.
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\ud800-\udfff]')


def _json_str(text: str) -> bytes:
    """json.dumps(text, ensure_ascii=False).encode(), with a fast path for plain text."""
    if _NEEDS_ESCAPE.search(text) is None:
        return b'"' + text.encode() + b'"'
    try:
        return json.dumps(text, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: escape it (\udXXX) rather than fail
        return json.dumps(text).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


class ChunkEncoder:
    """Pre-encoded SSE chunks of one streamed request.

    `content(text)` is the per-token path: it only JSON-escapes the text. The bytes are
    exactly what `json.dumps` of the OpenAI chunk object gives (tested).
    """

    __slots__ = (
        "_fin_mid",
        "_head",
        "_mid",
        "_tail",
        "_usage_tail",
        "created",
        "include_usage",
        "kind",
        "model",
        "rid",
    )

    def __init__(self, kind: str, rid: str, created: int, model: str,
                 include_usage: bool) -> None:
        self.kind = kind
        self.rid = rid
        self.created = created
        self.model = model
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = (b'data: {"id":' + _dumps(rid) + b',"object":"' + obj.encode()
                + b'","created":' + str(created).encode() + b',"model":' + _dumps(model)
                + b',"choices":[{"index":0,')
        self._usage_tail = b',"usage":null' if include_usage else b""
        if kind == "chat":
            self._head = head + b'"delta":{"content":'
            self._mid = b'},"logprobs":null,"finish_reason":'
        else:
            self._head = head + b'"text":'
            self._mid = b',"logprobs":null,"finish_reason":'
        self._tail = b"}]" + self._usage_tail + b"}\n\n"

    def _obj(self, choices: list, usage_val: Any = ..., ) -> dict[str, Any]:
        d = {"id": self.rid,
             "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
             "created": self.created, "model": self.model, "choices": choices}
        if usage_val is not ...:
            d["usage"] = usage_val
        elif self.include_usage:
            d["usage"] = None
        return d

    def role(self) -> bytes:
        """The first chat chunk: the assistant role and empty content."""
        return sse(self._obj([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]))

    def content(self, text: str, finish_reason: str | None = None) -> bytes:
        fr = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        return self._head + _json_str(text) + self._mid + fr + self._tail

    def finish(self, finish_reason: str) -> bytes:
        """A last chunk that carries only the finish reason (no new text)."""
        if self.kind == "chat":
            return sse(self._obj([{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": finish_reason}]))
        return self.content("", finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse(self._obj([], usage(prompt_tokens, completion_tokens)))


def now() -> int:
    return int(time.time())
