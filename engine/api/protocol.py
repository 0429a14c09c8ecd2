"""OpenAI wire protocol: request validation, response and chunk shapes, error JSON.

Pure Python (no torch, no aiohttp): `server.py` calls these. The request fields of both
generation endpoints are declared once, as `schema` fields (`RequestSchemas`): the same
table validates a decoded body and is published in /openapi.json. Every numeric field is
bounded by what the engine can do (token ids and `top_k` by the vocabulary, lengths by
`max_model_len`, seeds by int64, floats finite); a field of the wrong type or out of range is
a 400 naming it (`param`). A field this server does not know is refused too (a 400
naming it), except the harmless OpenAI metadata of `HARMLESS_METADATA`. Validation turns a body into a
`CompletionRequest` (prompt still as text, ids or chat messages).

Streaming is the hot path (200 streams x ~100 tokens/s each on the GPU), so a
`ChunkEncoder` pre-encodes each request's constant JSON around the content and
a token costs one `json.dumps` of its text and two byte concatenations.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .schema import AnyOf, Array, Bool, Field, Int, Invalid, Num, Obj, Str
from ..sampling.logprobs import MAX_LOGPROBS, TokenLogprob
from ..sampling.penalties import MAX_LOGIT_BIAS
from ..core.request import PENALTY_RANGES, SamplingParams
from ..sampling.structured import MAX_CHOICE_OPTIONS, MAX_GRAMMAR_CHARS, GrammarSpec
from .tools import MARKED_BY_SPECIAL_TOKENS, parameters, required_schema

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
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}  # every other 4xx: invalid_request_error


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# A client's own text quoted back in an error is cut to this: an error must not echo a
# megabyte the client sent.
SHOWN_CHARS = 80


def shown(text: str) -> str:
    """`text` as an error message quotes it: at most SHOWN_CHARS characters."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text)} characters)"


# --------------------------------------------------------------------------- the request


@dataclass
class CompletionRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt_text: str | None = None  # completions, text prompt
    prompt_ids: list[int] | None = None  # completions, token-id prompt
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: every prompt (the first above)
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # top alternatives per output token (chat: top_logprobs)
    echo: bool = False  # completions: the prompt before the output (and its logprobs)
    prompt_logprobs: int | None = None  # top alternatives per prompt token the engine computes
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was sent: answer it
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N", not by their text
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False
    grammar: GrammarSpec | None = None  # structured outputs: compiled by the server
    tools: list[dict[str, Any]] | None = None   # as sent (passed to the chat template)
    tool_choice: str = "none"    # none | auto | required | named (tool_name)
    tool_name: str | None = None

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompt (the `param` of a context error)."""
        return "messages" if self.kind == "chat" else "prompt"


@dataclass
class TokenizeRequest:
    """A validated /tokenize request: a text prompt or chat messages."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


@dataclass(frozen=True)
class Limits:
    """What the served engine can do: every request bound derives from these."""

    max_model_len: int
    vocab_size: int
    # Text longer than this cannot fit max_model_len tokens whatever it says (from the
    # tokenizer: see text_bound.py); None when the tokenizer gives no such bound.
    max_prompt_chars: int | None = None
    # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto" is served
    tool_parser: str | None = None
    # --max-logprobs: the most alternatives a request may ask for (the engine's cap at most)
    max_logprobs: int = MAX_LOGPROBS


# OpenAI request metadata that changes nothing about the answer: accepted and ignored.
# Any other field this server does not implement is refused with a 400 naming it.
HARMLESS_METADATA = (("user", Str()), ("metadata", Obj(values=Str())), ("store", Bool()),
                     ("service_tier", Str()), ("prompt_cache_key", Str()),
                     ("safety_identifier", Str()))

# Engine requests one API request may make (prompts x n): each holds a slot and its KV.
MAX_CHOICES = 128
# Prompt logprobs (echo + logprobs, prompt_logprobs): prompt tokens x (1 + alternatives)
# summed over every choice of the request (prompts x n), at most this many (the answer's
# size; about 40 bytes of JSON each).
MAX_PROMPT_LOGPROB_ENTRIES = 65536

# Variables the request sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools", "documents")
MAX_TOOLS = 128
# OpenAI's documented default for /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Nesting deeper than this is refused before validation walks it (no request needs > 5).
MAX_JSON_DEPTH = 64
# Stop strings are matched against the output text after every token (the poller's
# time, shared by all streams), so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_ROLES = ("system", "user", "assistant", "tool", "developer")


def _context_exceeded(max_model_len: int, what: str) -> str:
    return (f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your {what}. Please reduce the length of the {what.split()[0]}.")


class RequestSchemas:
    """The request bodies of /v1/completions and /v1/chat/completions for one served
    engine: `completion` and `chat` are `schema.Obj` tables (validation and schema)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        mml, vocab = limits.max_model_len, limits.vocab_size
        token_id = Int(0, vocab - 1, hi_why=f"(the vocabulary has {vocab} tokens)")
        max_tokens = Int(1, mml, hi_why="(max_model_len)")
        doc_max = "Tokens to generate; null: what the context leaves."
        schema_t = AnyOf((Str(1, MAX_GRAMMAR_CHARS), Obj(closed=False)),
                         "a JSON schema (an object or its JSON text)")
        grammar_t = Str(1, MAX_GRAMMAR_CHARS)
        choice_t = Array(Str(1, 1024), 1, MAX_CHOICE_OPTIONS)
        common = (
            Field("model", Str(), doc="A served model name (GET /v1/models)."),
            Field("stream", Bool()),
            Field("stream_options", Obj((
                Field("include_usage", Bool()),
                Field("continuous_usage_stats", Bool(), only=False,
                      only_why="usage comes in the last chunk only (include_usage)"))),
                  doc="Only with stream: true."),
            Field("n", Int(1, MAX_CHOICES), doc=f"Choices per prompt; at most {MAX_CHOICES} "
                  "choices per request in all."),
            Field("best_of", Int(1, 128), only=1, only_why="only best_of=1"),
            Field("priority", Int(INT64_MIN, INT64_MAX), only=0,
                  only_why="requests are served first come first served (vLLM's priority "
                  "scheduling is not served)"),
            Field("temperature", Num(0.0, 2.0), doc="0 = greedy."),
            Field("top_p", Num(0.0, 1.0, lo_open=True)),
            Field("top_k", Int(-1, vocab, hi_why="(the vocabulary size)"),
                  doc="-1 or 0: off."),
            Field("min_tokens", Int(0, mml, hi_why="(max_model_len)")),
            Field("seed", Int(INT64_MIN, INT64_MAX)),
            Field("stop", AnyOf((Str(1, MAX_STOP_CHARS),
                                 Array(Str(1, MAX_STOP_CHARS), max_items=MAX_STOP_STRINGS)),
                                "a string or a list of strings")),
            Field("stop_token_ids", Array(token_id, max_items=MAX_STOP_TOKEN_IDS)),
            Field("ignore_eos", Bool()),
            *(Field(name, Num(lo, hi)) for name, (lo, hi) in PENALTY_RANGES.items()),
            Field("logit_bias", Obj(values=Num(-100.0, 100.0)),
                  doc=f"Token id (a string) -> a value added to its logit; at most "
                      f"{MAX_LOGIT_BIAS} entries, ids below {vocab}."),
            Field("min_p", Num(0.0, 1.0), doc="Drop tokens below min_p x the top "
                  "token's probability; 0: off."),
            Field("include_stop_str_in_output", Bool(),
                  doc="Keep the matched stop string at the end of the text."),
            Field("skip_special_tokens", Bool(), doc="Default true."),
            Field("return_tokens_as_token_ids", Bool(), doc="vLLM's: logprobs name each token "
                  "\"token_id:N\" instead of its text (ids that decode alike stay apart)."),
            Field("spaces_between_special_tokens", Bool(), only=True,
                  only_why="special tokens are always decoded as the tokenizer joins them"),
            Field("prompt_logprobs", Int(0, limits.max_logprobs), doc="vLLM's: the logprob, rank "
                  "and this many top alternatives of each prompt token (the first null); "
                  f"prompt tokens x choices x (1 + this) <= {MAX_PROMPT_LOGPROB_ENTRIES}; not with "
                  "stream."),
            Field("structured_outputs", Obj((
                Field("json", schema_t, doc="A JSON schema the output follows."),
                Field("json_object", Bool(), doc="true: any JSON object."),
                Field("regex", grammar_t, doc="A regular expression the output matches."),
                Field("choice", choice_t, doc="The output is one of these strings."),
                Field("grammar", grammar_t, doc="An EBNF grammar (xgrammar's dialect)."),
            )), doc="vLLM's structured outputs (xgrammar): at most one constraint."),
            Field("guided_json", schema_t, doc="vLLM's older name of structured_outputs.json."),
            Field("guided_regex", grammar_t, doc="Older name of structured_outputs.regex."),
            Field("guided_choice", choice_t, doc="Older name of structured_outputs.choice."),
            Field("guided_grammar", grammar_t, doc="Older name of structured_outputs.grammar."),
            *(Field(f"guided_{k}", Str(), refused=True,
                    only_why="the backend is always xgrammar, with its default whitespace")
              for k in ("decoding_backend", "whitespace_pattern")),
            # harmless OpenAI metadata: accepted and ignored (docs/engine-server.md)
            *(Field(name, t, doc="OpenAI metadata: accepted, ignored.")
              for name, t in HARMLESS_METADATA),
        )
        over_ids = _context_exceeded(mml, "prompt has {n} tokens, which leaves no room "
                                          "for output")
        stream_rule = (("stream_options", "stream", True),)
        self.completion = Obj(when=stream_rule, fields=common + (
            Field("prompt", required=True, type=AnyOf((
                Str(1),
                Array(token_id, 1, mml - 1, "context_length_exceeded", over_ids),
                Array(Str(1), 1, MAX_CHOICES, "unsupported", "'{path}' holds at most "
                      f"{MAX_CHOICES} prompts (got {{n}})"),
                Array(Array(token_id, 1, mml - 1, "context_length_exceeded", over_ids),
                      1, MAX_CHOICES, "unsupported", "'{path}' holds at most "
                      f"{MAX_CHOICES} prompts (got {{n}})"),
            ), "a string, a list of token ids, or a list of those")),
            Field("max_tokens", max_tokens, null_ok=True, doc=doc_max + " Default 16."),
            Field("echo", Bool(), doc="The prompt before the output (with logprobs: and "
                  "the prompt tokens' logprobs, the first null)."),
            Field("logprobs", Int(0, limits.max_logprobs), doc="Logprobs of each output token and "
                  "of this many top alternatives (raw model logprobs, as vLLM's default)."),
            Field("suffix", Str(), only="", only_why="no insertion with a suffix"),
        ))
        part = Obj((Field("type", Str(), required=True, only="text",
                          only_why="text content parts only"),
                    Field("text", Str(), required=True)))
        message = Obj((
            Field("role", Str(enum=_ROLES), required=True),
            Field("content", AnyOf((Str(), Array(part)),
                                   "a string or a list of content parts")),
            Field("name", Str()),
            Field("refusal", Str(), doc="An earlier refusal: ignored."),
            Field("tool_calls", Array(Obj((
                Field("id", Str()), Field("type", Str(enum=("function",))),
                Field("function", Obj((Field("name", Str(), required=True),
                                       Field("arguments", Str(), required=True))),
                      required=True))), max_items=MAX_TOOLS),
                  doc="An assistant's earlier tool calls (passed to the chat template)."),
            Field("tool_call_id", Str(), doc="The call a tool message answers."),
        ))
        tool = Obj((
            Field("type", Str(enum=("function",)), required=True),
            Field("function", Obj((
                Field("name", Str(1, 64), required=True), Field("description", Str()),
                Field("parameters", Obj(closed=False)), Field("strict", Bool()))),
                  required=True)))
        tool_choice = AnyOf((Str(enum=("none", "auto", "required")), Obj((
            Field("type", Str(enum=("function",)), required=True),
            Field("function", Obj((Field("name", Str(), required=True),)), required=True)))),
            "'none', 'auto', 'required' or {type: function, function: {name}}")
        self.chat = Obj(when=stream_rule, fields=common + (
            Field("messages", Array(message, 1, mml, "context_length_exceeded",
                                    _context_exceeded(mml, "messages are {n}, more than "
                                                           "could fit")), required=True),
            Field("max_completion_tokens", max_tokens, null_ok=True, doc=doc_max),
            Field("max_tokens", max_tokens, null_ok=True,
                  doc=doc_max + " (max_completion_tokens wins)."),
            Field("add_generation_prompt", Bool()),
            Field("logprobs", Bool(), doc="Logprobs of each output token (raw model "
                  "logprobs, as vLLM's default)."),
            Field("top_logprobs", Int(0, limits.max_logprobs), doc="Top alternatives per token "
                  "(needs logprobs: true)."),
            Field("tools", Array(tool, 0, MAX_TOOLS), doc="Functions the model may call "
                  "(passed to the chat template)."),
            Field("tool_choice", tool_choice, doc="Default: auto with tools (needs "
                  "--enable-auto-tool-choice and --tool-call-parser), else none. required / "
                  "a named function: enforced by structured outputs."),
            Field("parallel_tool_calls", Bool(), doc="Accepted; required may call several."),
            Field("response_format", Obj((
                Field("type", Str(enum=("text", "json_object", "json_schema")), required=True),
                Field("json_schema", Obj((
                    Field("name", Str()), Field("description", Str()),
                    Field("schema", Obj(closed=False)),
                    Field("strict", Bool(), doc="Always enforced (xgrammar's strict mode).")
                )), doc="With type json_schema."))),
                doc="json_object / json_schema: the output follows it (xgrammar)."),
            Field("chat_template_kwargs", Obj(values=AnyOf(
                (Str(), Num(), Bool(), Array(Str()), Obj(closed=False)), "a JSON value")),
                doc="Extra variables for the chat template (e.g. enable_thinking)."),
            Field("documents", Array(Obj(values=Str())),
                  doc="Passed to the chat template as `documents` (RAG templates)."),
            Field("continue_final_message", Bool(),
                  doc="Continue the last (assistant) message instead of starting a new one."),
            Field("chat_template", Str(), refused=True,
                  only_why="the chat template is the server's (--chat-template)"),
        ))

        # vLLM's /tokenize and /detokenize bodies (one table each, published too)
        self.tokenize = Obj((
            Field("model", Str()),
            Field("prompt", Str(), doc="Text to tokenize (or messages)."),
            Field("messages", Array(message, 1, mml), doc="Chat messages, rendered by the "
                  "chat template, to tokenize (or prompt)."),
            Field("add_special_tokens", Bool(), doc="Default: true for a prompt, false for "
                  "messages (the template adds them)."),
            Field("add_generation_prompt", Bool()),
            Field("return_token_strs", Bool()),
        ))
        self.detokenize = Obj((
            Field("model", Str()),
            Field("tokens", Array(token_id, 1, mml), required=True),
        ))

    # ---------------------------------------------------------------- parsing

    def parse_tokenize(self, body: Any) -> TokenizeRequest:
        v = _check(self.tokenize, body)
        if (v["prompt"] is None) == (v["messages"] is None):
            raise bad("send exactly one of 'prompt' and 'messages'", "prompt")
        text_len = len(v["prompt"]) if v["prompt"] is not None else 0
        messages = None
        if v["messages"] is not None:
            messages = [_message(m) for m in v["messages"]]
            text_len = sum(len(m["content"]) for m in messages)
        self._check_text_len(text_len, "prompt" if messages is None else "messages")
        special = v["add_special_tokens"]
        gen = v["add_generation_prompt"]
        return TokenizeRequest(v["model"], v["prompt"], messages,
                               (messages is None) if special is None else special,
                               True if gen is None else gen, bool(v["return_token_strs"]))

    def parse_detokenize(self, body: Any) -> tuple[str | None, list[int]]:
        v = _check(self.detokenize, body)
        return v["model"], v["tokens"]

    def parse_completion(self, body: Any) -> CompletionRequest:
        """Validate a decoded /v1/completions body."""
        v = _check(self.completion, body)
        req = CompletionRequest(kind="completion", model=v["model"])
        _common(v, req, self.limits.vocab_size, body)
        prompt = v["prompt"]
        prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
        _check_choices(len(prompts) * req.n)
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                self._check_text_len(len(p), "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        req.prompts = prompts
        if isinstance(prompts[0], str):
            req.prompt_text = prompts[0]
        else:
            req.prompt_ids = prompts[0]
        req.echo = bool(v["echo"])
        req.logprobs = v["logprobs"]
        if req.echo and req.logprobs is not None:   # the prompt tokens' logprobs too
            req.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        if "max_tokens" not in body:
            req.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's default
        else:
            req.max_tokens = v["max_tokens"]  # null: what the context leaves
        return req

    def parse_chat(self, body: Any) -> CompletionRequest:
        """Validate a decoded /v1/chat/completions body."""
        v = _check(self.chat, body)
        req = CompletionRequest(kind="chat", model=v["model"])
        _common(v, req, self.limits.vocab_size, body)
        req.messages = [_message(m) for m in v["messages"]]
        _check_choices(req.n)
        if v["top_logprobs"] is not None and not v["logprobs"]:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if v["logprobs"]:
            req.logprobs = v["top_logprobs"] or 0
        self._check_text_len(sum(len(m["content"]) for m in req.messages), "messages")
        mct = v["max_completion_tokens"]
        req.max_tokens = mct if mct is not None else v["max_tokens"]
        if v["add_generation_prompt"] is not None:
            req.add_generation_prompt = v["add_generation_prompt"]
        req.chat_template_kwargs = dict(v["chat_template_kwargs"] or {})
        for k in RESERVED_TEMPLATE_VARS:
            if k in req.chat_template_kwargs:
                raise bad(f"'chat_template_kwargs.{k}' is set by the request itself, not "
                          "through chat_template_kwargs", f"chat_template_kwargs.{k}")
        self._tools(v, body, req)
        if req.stream and req.tool_choice != "none" and req.logprobs is not None:
            # a streamed required / auto choice sends parsed calls: its chunks do not
            # line up with tokens
            raise bad("'logprobs' with a streamed 'tool_choice' other than \"none\" is not "
                      "supported by this server; send stream: false", "logprobs", "unsupported")
        if v["documents"] is not None:
            req.chat_template_kwargs["documents"] = v["documents"]
        if v["continue_final_message"]:
            if req.messages[-1]["role"] != "assistant":
                raise bad("'continue_final_message' needs the last message to be the "
                          "assistant's", "continue_final_message")
            if v["add_generation_prompt"]:
                raise bad("'continue_final_message' and 'add_generation_prompt' cannot both "
                          "be true", "continue_final_message")
            req.continue_final_message = True
            req.add_generation_prompt = False
        return req

    def _tools(self, v: dict[str, Any], body: dict[str, Any], req: CompletionRequest) -> None:
        """tools and tool_choice: required / named become the request's grammar."""
        tools = body["tools"] if v["tools"] else None   # as sent: parameter schemas whole
        choice = v["tool_choice"]
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, dict):
            req.tool_name = choice["function"]["name"]
            choice = "named"
        if choice != "none" and not tools:
            raise bad(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        if choice == "auto" and self.limits.tool_parser is None:
            raise bad("'tool_choice' \"auto\" (the default with tools) needs the server to "
                      "run with --enable-auto-tool-choice and --tool-call-parser; send "
                      "'tool_choice' \"none\", \"required\" or a named function", "tool_choice",
                      "unsupported")
        schema = None
        if choice == "required":
            schema = required_schema(tools)
        elif choice == "named":
            named = [t for t in tools if t["function"]["name"] == req.tool_name]
            if not named:
                raise bad(f"'tool_choice' names {req.tool_name!r}, which is not in 'tools'",
                          "tool_choice")
            schema = parameters(named[0])   # the output is the call's arguments
        if schema is not None:
            if req.grammar is not None:
                raise bad(f"'tool_choice' {choice!r} is enforced by structured outputs: it "
                          f"cannot be combined with '{req.grammar.param}'", "tool_choice")
            req.grammar = GrammarSpec("json", _schema_text(schema, "tools"), "tools")
        req.tools, req.tool_choice = tools, choice
        if choice == "auto" and self.limits.tool_parser in MARKED_BY_SPECIAL_TOKENS:
            if body.get("skip_special_tokens") is True:   # asked for, and cannot be honoured
                raise bad(f"'skip_special_tokens' true cannot be honoured with tools and "
                          f"--tool-call-parser {self.limits.tool_parser}: the parser reads the "
                          f"call's special marker token; leave it unset or send false",
                          "skip_special_tokens", "unsupported")
            req.skip_special_tokens = False   # the parser reads the call's marker token

    def _check_text_len(self, chars: int, where: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context whatever it says."""
        bound = self.limits.max_prompt_chars
        if bound is not None and chars > bound:
            raise bad(_context_exceeded(
                self.limits.max_model_len, f"{where} text has {chars} characters, more "
                f"than any {self.limits.max_model_len} tokens of this tokenizer can hold "
                f"({bound})"), where, "context_length_exceeded")


def _check_choices(n: int) -> None:
    if n > MAX_CHOICES:
        raise bad(f"a request makes at most {MAX_CHOICES} choices (prompts x n), got {n}", "n")


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A validated chat message as the chat template takes it (content parts joined;
    tool-call arguments as objects, as vLLM passes them: templates `tojson` them)."""
    content = m["content"]
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    msg = {"role": m["role"], "content": content or ""}
    if m["name"] is not None:
        msg["name"] = m["name"]
    if m["tool_call_id"] is not None:
        msg["tool_call_id"] = m["tool_call_id"]
    if m["tool_calls"]:
        msg["tool_calls"] = [{"id": c["id"] or "", "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in m["tool_calls"]]
    return msg


def _arguments(text: str) -> Any:
    try:
        args = json.loads(text)
    except ValueError:
        return text
    return args if isinstance(args, dict) else text


def _check(table: Obj, body: Any) -> dict[str, Any]:
    try:
        return table.check(body)
    except Invalid as exc:
        raise bad(exc.message, exc.param, exc.code) from None


def _common(v: dict[str, Any], req: CompletionRequest, vocab: int, body: dict[str, Any]) -> None:
    """Fields shared by both endpoints, from validated values (None: absent); `body`
    gives the JSON schemas as sent (validation keeps only the fields it declares)."""
    req.stream = bool(v["stream"])
    if v["n"] is not None:
        req.n = v["n"]
    if v["stream_options"] is not None:  # only with stream true (the tables' `when`)
        req.include_usage = bool(v["stream_options"]["include_usage"])
    for name in ("temperature", "top_p", "min_tokens", "seed", "ignore_eos", "min_p",
                 "include_stop_str_in_output", "skip_special_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "return_tokens_as_token_ids"):
        if v[name] is not None:
            setattr(req, name, v[name])
    if v["top_k"] is not None:
        req.top_k = 0 if v["top_k"] == -1 else v["top_k"]
    stop = v["stop"]
    if stop is not None:
        req.stop = [stop] if isinstance(stop, str) else stop
    if v["stop_token_ids"] is not None:
        req.stop_token_ids = v["stop_token_ids"]
    if v["logit_bias"]:
        req.logit_bias = _logit_bias(v["logit_bias"], vocab)
    if v["prompt_logprobs"] is not None:
        if req.stream:   # as vLLM
            raise bad("'prompt_logprobs' is not available with stream: true", "prompt_logprobs",
                      "unsupported")
        req.prompt_logprobs, req.show_prompt_logprobs = v["prompt_logprobs"], True
    req.grammar = _grammar(v, body)
    if req.grammar is not None and (req.min_tokens or req.ignore_eos):
        raise bad("'min_tokens' and 'ignore_eos' cannot be used with structured outputs "
                  "(the grammar decides where the output ends)",
                  "min_tokens" if req.min_tokens else "ignore_eos")


JSON_OBJECT = '{"type": "object"}'   # response_format json_object: any JSON object


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as JSON text (what xgrammar compiles), bounded in size."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise bad(f"'{param}' must be a JSON schema object", param)
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad(f"'{param}' is longer than {MAX_GRAMMAR_CHARS} characters", param)
    return text


def _grammar(v: dict[str, Any], body: dict[str, Any]) -> GrammarSpec | None:
    """The one structured-output constraint of the request, from any of its spellings
    (response_format, structured_outputs, guided_*); more than one is a 400."""
    found: list[tuple[str, GrammarSpec]] = []
    so = v["structured_outputs"] or {}
    rf = v.get("response_format")
    raw_so = body.get("structured_outputs") or {}
    for key, kind in (("json", "json"), ("regex", "regex"), ("choice", "choice"),
                      ("grammar", "grammar")):
        for param, x in ((f"structured_outputs.{key}", so.get(key)), (f"guided_{key}", v[f"guided_{key}"])):
            if x is None:
                continue
            if kind == "json":   # the schema as sent (validation kept no members)
                raw = raw_so["json"] if param.startswith("structured") else body["guided_json"]
                found.append((param, GrammarSpec("json", _schema_text(raw, param))))
            elif kind == "choice":
                found.append((param, GrammarSpec("choice", json.dumps(x, ensure_ascii=False))))
            else:
                found.append((param, GrammarSpec(kind, x)))
    if so.get("json_object"):
        found.append(("structured_outputs.json_object", GrammarSpec("json", JSON_OBJECT)))
    if rf is not None and rf["type"] == "json_object":
        found.append(("response_format", GrammarSpec("json", JSON_OBJECT)))
    elif rf is not None and rf["type"] == "json_schema":
        js = rf["json_schema"]
        if js is None or js["schema"] is None:
            raise bad("'response_format.json_schema.schema' is required with type "
                      "json_schema", "response_format.json_schema")
        found.append(("response_format", GrammarSpec(
            "json", _schema_text(body["response_format"]["json_schema"]["schema"],
                                 "response_format.json_schema.schema"))))
    if len(found) > 1:
        raise bad(f"give one structured-output constraint, got {len(found)}: "
                  f"{', '.join(p for p, _ in found)}", found[1][0])
    if not found:
        return None
    param, spec = found[0]
    return GrammarSpec(spec.kind, spec.value, param)


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                  "logit_bias")
    out = {}
    for k, b in bias.items():
        if not (k.isascii() and k.isdigit() and int(k) < vocab):
            raise bad(f"'logit_bias' keys must be token ids below {vocab}, got {k!r:.40}",
                      f"logit_bias.{k}"[:80])
        out[int(k)] = b
    return out


def parse_body(raw: bytes) -> Any:
    """Decode a JSON request body or raise a 400 (NaN / Infinity are not JSON)."""
    if not raw:
        raise bad("the request body is empty; expected a JSON object")
    too_deep = bad(f"the request JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    # A body with few brackets cannot be deep: skip the walk (a long id list has one).
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body,
                                                                            MAX_JSON_DEPTH):
        raise too_deep
    return body


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _deeper_than(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        for child in (o.values() if isinstance(o, dict) else o):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def check_context(req: CompletionRequest, prompt_len: int, max_model_len: int,
                  default_max_tokens: int | None = None) -> int:
    """Settle max_tokens against the context; return it or raise a 400 (vLLM's wording).

    A request without max_tokens gets what the context leaves, capped by
    `default_max_tokens` when the server sets one (the engine reserves KV pages for
    prompt + max_tokens at admission, so "the whole context" is a large reservation)."""
    where = req.prompt_field
    if prompt_len >= max_model_len:
        raise bad(_context_exceeded(max_model_len, f"{where} has {prompt_len} tokens, which "
                                    "leaves no room for output"), where,
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


def check_prompt_logprobs(req: CompletionRequest, prompt_tokens: int, choices: int = 1) -> None:
    """Refuse a request whose prompt logprobs would exceed MAX_PROMPT_LOGPROB_ENTRIES:
    `prompt_tokens` counts every choice's prompt (prompts x n), since each choice carries
    its prompt's entries in the answer."""
    k = req.prompt_logprobs
    if k is None or prompt_tokens * (1 + k) <= MAX_PROMPT_LOGPROB_ENTRIES:
        return
    param = "prompt_logprobs" if req.show_prompt_logprobs else "logprobs"
    raise bad(f"prompt logprobs of {prompt_tokens} prompt tokens over {choices} choice(s) x "
              f"(1 + {k} alternatives) exceed this server's cap of "
              f"{MAX_PROMPT_LOGPROB_ENTRIES} entries per request (MAX_PROMPT_LOGPROB_ENTRIES); "
              "send a shorter prompt, fewer choices or fewer alternatives",
              param, "prompt_logprobs_too_large")


def sampling_params(req: CompletionRequest, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for this request (max_tokens settled by check_context)."""
    if req.min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({req.min_tokens}) must be <= max_tokens ({max_tokens})",
                  "min_tokens")
    try:
        return _sampling_params(req, max_tokens)
    except ValueError as exc:  # the engine's own bounds: a second line behind the schema
        field_name = str(exc).split(" ", 1)[0]
        raise bad(str(exc), field_name if field_name.isidentifier() else None) from None


def _sampling_params(req: CompletionRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                          stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                          ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                          min_p=req.min_p, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty,
                          logit_bias=dict(req.logit_bias),
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens,
                          logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)


# --------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(12).hex()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None,
                      prompt_logprobs: list | None = None) -> dict[str, Any]:
    c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:   # only when asked (vLLM's field)
        c["prompt_logprobs"] = prompt_logprobs
    return c


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_val: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_val}


def chat_response(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_val: dict[str, Any], prompt_logprobs: list | None = None) -> dict[str, Any]:
    r = {"id": rid, "object": "chat.completion", "created": created, "model": model,
         "choices": choices, "usage": usage_val}
    if prompt_logprobs is not None:   # only when asked (vLLM's field)
        r["prompt_logprobs"] = prompt_logprobs
    return r


def completion_logprobs(entries: list[TokenLogprob], tok_str: Callable[[int], str],
                        offset: int = 0, top_n: int | None = None) -> dict[str, Any]:
    """/v1/completions' logprobs object; as vLLM's, each top_logprobs dict holds the top
    alternatives (at most top_n) and the chosen token, and text_offset counts the token
    strings from `offset`. A prompt's first token has null logprob and top_logprobs."""
    tokens = [tok_str(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops: list[dict[str, float] | None] = []
    for e, t in zip(entries, tokens):
        if e.logprob is None:
            tops.append(None)
            continue
        d = {tok_str(i): lp for i, lp in e.top[:top_n]}
        d.setdefault(t, e.logprob)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list[TokenLogprob], tok_str: Callable[[int], str],
                         top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} of the top_n alternatives (ranks 1..) and the token itself."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": lp, "rank": rank, "decoded_token": tok_str(i)}
             for rank, (i, lp) in enumerate(e.top[:top_n], 1)}
        d.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank,
                                       "decoded_token": tok_str(e.token_id)})
        out.append(d)
    return out


def chat_logprobs(entries: list[TokenLogprob], tok_str: Callable[[int], str]) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object (`content`, a list per token)."""
    def one(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}

    return {"content": [{**one(tok_str(e.token_id), e.logprob),
                         "top_logprobs": [one(tok_str(i), lp) for i, lp in e.top]}
                        for e in entries]}


def models_response(names: list[str], max_model_len: int, root: str,
                    created: int, adapters: list[tuple[str, str, str | None]] = ()) -> dict[str, Any]:
    """The served names, then each LoRA adapter (name, path, base model name or None) as
    vLLM lists them: root = its path, parent = its base (default: the first served name)."""
    return {"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "zerod",
         "root": root, "parent": None, "max_model_len": max_model_len}
        for n in names] + [
        {"id": n, "object": "model", "created": created, "owned_by": "zerod",
         "root": path, "parent": parent or names[0], "max_model_len": max_model_len}
        for n, path, parent in adapters]}


LORA_LOAD_FIELDS = ("lora_name", "lora_path")
LORA_UNLOAD_FIELDS = ("lora_name",)


# An adapter's name is listed by /v1/models and /health and named in every log line of
# its requests; its path is a filesystem path (PATH_MAX).
LORA_FIELD_CHARS = {"lora_name": 128, "lora_path": 4096}


def parse_lora_request(body: Any, with_path: bool) -> tuple[str, str | None]:
    """The body of /v1/load_lora_adapter ({lora_name, lora_path}) or
    /v1/unload_lora_adapter ({lora_name}) -> (name, path or None)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    fields = LORA_LOAD_FIELDS if with_path else LORA_UNLOAD_FIELDS
    for k in body:
        if k not in fields:   # nothing is silently ignored (vLLM's load_inplace included)
            raise bad(f"unknown field '{k}': this endpoint takes {', '.join(fields)}", k)
    for f in fields:
        v = body.get(f)
        if not isinstance(v, str) or not v.strip():
            raise bad(f"'{f}' must be a non-empty string", f)
        if len(v) > LORA_FIELD_CHARS[f]:
            raise bad(f"'{f}' is longer than {LORA_FIELD_CHARS[f]} characters", f)
    return body["lora_name"].strip(), body["lora_path"].strip() if with_path else None


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

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None,
              index: int = 0) -> bytes:
        """A chat chunk of choice `index` with any delta (tool calls; not the per-token
        path)."""
        return sse(self._obj([{"index": index, "delta": delta, "logprobs": None,
                               "finish_reason": finish_reason}]))

    def finish(self, finish_reason: str) -> bytes:
        """A last chunk that carries only the finish reason (no new text)."""
        if self.kind == "chat":
            return sse(self._obj([{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": finish_reason}]))
        return self.content("", finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        return sse(self._obj([], usage(prompt_tokens, completion_tokens, cached_tokens)))

    def choice(self, index: int, text: str | None, finish_reason: str | None,
               logprobs: dict[str, Any] | None = None, role: bool = False) -> bytes:
        """Any chunk of any choice (n > 1, a list of prompts, logprobs): the general,
        slower path beside content()'s. text None: no content (a chat finish chunk)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            c = completion_choice(index, text or "", finish_reason, logprobs)
        return sse(self._obj([c]))


def now() -> int:
    return int(time.time())
