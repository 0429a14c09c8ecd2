"""GET /openapi.json: the OpenAPI 3.1 description of this server.

The request bodies are `protocol.RequestSchemas`' own tables (the ones that validate
requests), with this engine's bounds filled in (vocabulary size, max_model_len, the text
bound). The response shapes are written here beside protocol.py's builders; the
schemathesis test (tests/test_api_schema.py) holds the server's answers to them.
"""

from __future__ import annotations

from typing import Any

from . import protocol as P

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULL = {"type": "null"}


def _obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **kw}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
               "prompt_tokens_details": _obj({"cached_tokens": _INT})})
_NUM = {"type": "number"}
_COMPLETION_LOGPROBS = {"anyOf": [_obj({
    "tokens": {"type": "array", "items": _STR},
    "token_logprobs": {"type": "array", "items": _NUM},
    "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": _NUM}},
    "text_offset": {"type": "array", "items": _INT}}), _NULL]}
_TOKEN_LP = {"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}}
_CHAT_LOGPROBS = {"anyOf": [_obj({"content": {"type": "array", "items": _obj({
    **_TOKEN_LP, "top_logprobs": {"type": "array", "items": _obj(_TOKEN_LP)}})}}), _NULL]}
_FINISH = {"anyOf": [{"enum": ["stop", "length", "abort", "error"]}, _NULL]}
_COMPLETION = _obj({
    "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
    "choices": {"type": "array", "items": _obj({
        "index": _INT, "text": _STR, "logprobs": _COMPLETION_LOGPROBS, "finish_reason": _FINISH})},
    "usage": _ref("Usage"),
})
_CHAT_COMPLETION = _obj({
    "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
    "choices": {"type": "array", "items": _obj({
        "index": _INT,
        "message": _obj({"role": {"const": "assistant"}, "content": _STR}),
        "logprobs": _CHAT_LOGPROBS, "finish_reason": _FINISH})},
    "usage": _ref("Usage"),
})
_ERROR = _obj({"error": _obj({
    "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "integer", "null"]}})})
_MODEL_LIST = _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj({
    "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
    # parent: null for a base model, the base's name for a LoRA adapter
    "root": _STR, "parent": {"type": ["string", "null"]}, "max_model_len": _INT})}})
_TOKENIZED = _obj({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
                   "token_strs": {"anyOf": [{"type": "array", "items": _STR}, _NULL]}})
_HEALTH = _obj({
    "status": {"enum": ["ok", "unhealthy", "draining"]}, "pid": _INT, "model": _STR,
    "max_model_len": _INT, "vocab_size": _INT, "inflight": _INT,
    "threads": {"type": "object", "additionalProperties": _INT},
    # the step loop's last step (null before the first): what a stalled engine did last
    "steps": _INT, "last_step": {"anyOf": [_obj({"rows": _INT, "prefill_tokens": _INT, "decodes": _INT,
                                                  "seconds": _NUM, "at": _NUM}), _NULL]},
}, required=["status", "pid", "model", "max_model_len", "vocab_size"])

_ERROR_TEXT = {
    400: "Invalid request: a field of the wrong type or out of range (`param` names it), "
         "an unsupported option (code `unsupported`), or a prompt that cannot fit the "
         "context (code `context_length_exceeded`).",
    401: "Missing or wrong API key (when the server has one).",
    404: "Unknown model (code `model_not_found`).",
    408: "The request body did not arrive in time.",
    413: "The request body is too large.",
    429: "The engine's wait line is full; see Retry-After.",
    503: "The server is shutting down or the engine is unhealthy; see Retry-After.",
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": _ERROR_TEXT[s],
                     "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def _json_ok(description: str, schema: dict) -> dict[str, Any]:
    return {"200": {"description": description,
                    "content": {"application/json": {"schema": schema}}}}


def _generation(op_id: str, summary: str, request: str, response: str) -> dict[str, Any]:
    ok = _json_ok(f"{summary} (stream false).", _ref(response))
    # OpenAPI 3.1: an event stream's schema describes one event
    ok["200"]["content"]["text/event-stream"] = {"schema": {
        "type": "object", "properties": {"data": _STR}, "required": ["data"],
        "description": "stream true: each event's data is a JSON chunk; the last is "
                       "`[DONE]`."}}
    return {"post": {
        "operationId": op_id, "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {**ok, **_errors(400, 401, 404, 408, 413, 429, 503)},
    }}


def _lora_route(op_id: str, summary: str, fields: tuple[str, ...]) -> dict[str, Any]:
    body = {"type": "object", "additionalProperties": False, "required": list(fields),
            "properties": {f: {"type": "string", "minLength": 1} for f in fields}}
    return {"post": {
        "operationId": op_id, "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "Done.", "content": {"text/plain": {"schema": _STR}}},
                      **_errors(400, 401, 404)}}}


def openapi_document(schemas: P.RequestSchemas, model_names: list[str],
                     runtime_lora: bool = False) -> dict[str, Any]:
    """runtime_lora: the server takes POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    lim = schemas.limits
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "zerod OpenAI-compatible API",
            "version": "1",
            "description": f"Serving {', '.join(model_names)}: max_model_len "
                           f"{lim.max_model_len}, vocabulary {lim.vocab_size} tokens. "
                           "With an API key, /v1/* needs `Authorization: Bearer KEY`.",
        },
        "paths": {
            "/v1/completions": _generation("createCompletion", "A text completion",
                                           "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generation("createChatCompletion", "A chat completion",
                                                "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "The served model names",
                "responses": {**_json_ok("The served model names.", _ref("ModelList")),
                              **_errors(401, 503)}}},
            "/health": {"get": {
                "operationId": "health", "summary": "Liveness of the server and engine",
                "responses": {
                    **_json_ok("Healthy.", _ref("Health")),
                    "503": {"description": "Unhealthy or draining.",
                            "content": {"application/json": {"schema": _ref("Health")}}}}}},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics",
                "responses": {"200": {"description": "Prometheus text format.",
                                      "content": {"text/plain": {"schema": _STR}}}}}},
            "/tokenize": {"post": {
                "operationId": "tokenize", "summary": "Token ids of a prompt or chat messages",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref("TokenizeRequest")}}},
                "responses": {**_json_ok("The token ids.", _ref("Tokenized")),
                              **_errors(400, 404, 408, 413)}}},
            "/detokenize": {"post": {
                "operationId": "detokenize", "summary": "The text of token ids",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref("DetokenizeRequest")}}},
                "responses": {**_json_ok("The text.", _obj({"prompt": _STR})),
                              **_errors(400, 404, 408, 413)}}},
            "/version": {"get": {
                "operationId": "version", "summary": "The server's version",
                "responses": _json_ok("The version.", _obj({"version": _STR}))}},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document",
                "responses": _json_ok("OpenAPI 3.1.", {"type": "object"})}},
        },
        "components": {"schemas": {
            "CompletionRequest": schemas.completion.schema(),
            "ChatCompletionRequest": schemas.chat.schema(),
            "Completion": _COMPLETION,
            "ChatCompletion": _CHAT_COMPLETION,
            "Usage": _USAGE,
            "Error": _ERROR,
            "ModelList": _MODEL_LIST,
            "Health": _HEALTH,
            "TokenizeRequest": schemas.tokenize.schema(),
            "DetokenizeRequest": schemas.detokenize.schema(),
            "Tokenized": _TOKENIZED,
        }},
    }
    if runtime_lora:
        doc["paths"]["/v1/load_lora_adapter"] = _lora_route(
            "loadLoraAdapter", "Load a LoRA adapter (PEFT directory) under a name", P.LORA_LOAD_FIELDS)
        doc["paths"]["/v1/unload_lora_adapter"] = _lora_route(
            "unloadLoraAdapter", "Unload a LoRA adapter (its requests in flight finish)", P.LORA_UNLOAD_FIELDS)
    return doc
