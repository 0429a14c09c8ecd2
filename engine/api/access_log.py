"""One access-log line per HTTP request, and vLLM's per-request detail log.

The access line (on by default, as uvicorn's under vLLM; `--disable-uvicorn-access-log`
turns it off) says method, path, status, request id, model, prompt and output
tokens, time to first token and duration. Generation requests fill a tally as
they run: the engine's output callbacks count tokens and stamp the first one (on
the poller thread: each choice writes only its own entry). The detail log
(`--enable-log-requests`, off by default as vLLM's) adds the prompt and the
sampling parameters of each generation request.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from aiohttp import web
from zerod.engine.logs import FIELDS

log = logging.getLogger("zerod.access")
requests_log = logging.getLogger("zerod.requests")


class Tally:
    """What the access line says about one generation request."""

    __slots__ = ("first_token_at", "model", "output_tokens", "prompt_tokens", "start")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.model: str | None = None
        self.prompt_tokens = 0
        self.first_token_at: float | None = None
        self.output_tokens: dict[int, int] = {}

    def counting(self, index: int, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        """The engine's output callback for choice `index`, counting as it passes."""

        def seen(out: Any) -> None:
            n = getattr(out, "completion_tokens", 0) or 0
            if n and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.output_tokens[index] = n
            callback(out)

        return seen


TALLY = web.RequestKey("zerod_tally", Tally)


def access_middleware(enabled: bool, request_id_key: Any) -> Callable:
    """The outermost middleware: a tally on every request, one line at its end."""

    @web.middleware
    async def access(request: web.Request, handler: Callable) -> web.StreamResponse:
        tally = request[TALLY] = Tally()
        status = 500  # a handler that raises past every other layer
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if enabled:
                fields = access_fields(request.method, request.path, status,
                                       request.get(request_id_key), tally, time.monotonic())
                log.info(line(fields), extra={FIELDS: fields})

    return access


def access_fields(method: str, path: str, status: int, rid: str | None, tally: Tally,
                  now: float) -> dict[str, Any]:
    """The access line's facts (also its journal / JSON fields)."""
    ttft = None if tally.first_token_at is None else (tally.first_token_at - tally.start) * 1000
    return {"method": method, "path": path, "status": status, "request_id": rid,
            "model": tally.model, "prompt_tokens": tally.prompt_tokens,
            "output_tokens": sum(tally.output_tokens.values()),
            "ttft_ms": None if ttft is None else round(ttft, 1),
            "duration_ms": round((now - tally.start) * 1000, 1)}


def line(f: dict[str, Any]) -> str:
    ttft = "-" if f["ttft_ms"] is None else f"{f['ttft_ms']:.1f}ms"
    return (f'"{f["method"]} {f["path"]}" {f["status"]} id={f["request_id"] or "-"} '
            f'model={f["model"] or "-"} prompt_tokens={f["prompt_tokens"]} '
            f'output_tokens={f["output_tokens"]} ttft={ttft} duration={f["duration_ms"]:.1f}ms')


def log_request(rid: str, req: Any, prompts: list[Any], params: Any,
                max_len: int | None = None) -> None:
    """--enable-log-requests: the prompt(s) (their first `max_len` characters, as
    --max-log-len) and sampling parameters of one request."""
    prompt = repr(req.messages if req.kind == "chat" else prompts)
    if max_len is not None and len(prompt) > max_len:
        prompt = prompt[:max_len] + f"... ({len(prompt)} characters)"
    requests_log.info("request %s: prompt=%s params=%r", rid, prompt, params)
