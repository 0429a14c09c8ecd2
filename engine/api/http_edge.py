"""The HTTP edge: what happens to a connection before and around the app's handlers.

- Errors aiohttp raises itself while parsing (a malformed request line, an oversize or
  invalid header, bad chunked framing, a bad Content-Encoding) are answered in OpenAI's
  error JSON with the right 4xx, like every other error of the server (`edge_error`).
- Slow and idle connections cannot pile up: the request head must arrive within
  `head_timeout` of the connection opening or of the previous response (idle keep-alive
  connections close after the same), the body within `body_timeout`; TCP keep-alive and
  TCP_USER_TIMEOUT close half-open connections (a peer gone without a FIN).
- At most `max_connections` are open at once; one more is answered 429 (JSON,
  Retry-After: overload, as a full wait line is) and closed, without touching the ones
  being served.
- `bind_socket` reserves the port before the model loads, and names the process holding it
  when it is taken.

See docs/engine-server.md for each limit and why.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from ..port_holder import port_holder

from . import protocol as P

log = logging.getLogger("zerod.engine.api.http_edge")


def _default_max_connections() -> int:
    """1024, or fewer when the open-file limit would run out first (every connection
    is a file descriptor; past the limit accept() fails in a loop)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft - 128))  # leave descriptors for weights, logs, CUDA


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int = 32 * 1024 * 1024
    head_timeout: float = 30.0       # request line + headers, and idle keep-alive
    body_timeout: float = 60.0       # the whole body, once the head is in
    max_connections: int = 0         # 0: _default_max_connections()
    keepalive_idle_s: int = 30       # TCP keep-alive probes after this much silence ...
    keepalive_interval_s: int = 10   # ... every this often ...
    keepalive_probes: int = 3        # ... and the peer is gone after this many unanswered
    user_timeout_ms: int = 60_000    # written data unacknowledged this long: peer gone

    def connection_bound(self) -> int:
        return self.max_connections or _default_max_connections()


# --------------------------------------------------------------------------- errors


def edge_error(exc: BaseException, limits: EdgeLimits) -> P.APIError | None:
    """The OpenAI-shaped error for an exception aiohttp raised, or None if not one of its."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return P.APIError(413, f"the request body is larger than {limits.max_body_bytes} "
                          "bytes", code="request_too_large")
    if isinstance(exc, RequestPayloadError):  # the body failed to decode while read
        exc = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        if isinstance(exc, RequestPayloadError):
            return P.APIError(400, f"malformed request body: {exc}")
    if isinstance(exc, LineTooLong):
        line, limit = (exc.args + ("", "?"))[:2]
        # aiohttp's parser hands over the offending bytes: the target (it starts with
        # "/" or a scheme) when the request line is too long, else a header
        if bytes(line[:4]) in (b"http", b"HTTP") or bytes(line[:1]) == b"/":
            return P.APIError(414, f"the request target is longer than {limit} bytes")
        return P.APIError(431, f"a request header is longer than {limit} bytes")
    if isinstance(exc, BadHttpMethod):
        return P.APIError(400, f"not an HTTP request: {exc.message}")
    if isinstance(exc, HttpProcessingError):
        status = exc.code if 400 <= exc.code < 500 else 400
        msg = exc.message or type(exc).__name__
        if "too many headers" in msg.lower():
            status = 431
        return P.APIError(status, f"malformed HTTP request: {msg}")
    return None


def _json_response(err: P.APIError) -> web.Response:
    return web.Response(body=json.dumps(err.body()).encode(), status=err.status,
                        content_type="application/json", headers=err.headers or None)


def _raw_json_response(err: P.APIError) -> bytes:
    """A whole HTTP/1.1 response, for a connection refused before any parsing."""
    body = json.dumps(err.body()).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in err.headers.items())
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(err.status, "Error")
    return (f"HTTP/1.1 {err.status} {reason}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n"
            ).encode() + body


# --------------------------------------------------------------------------- connections


class EdgeProtocol(RequestHandler):
    """aiohttp's per-connection handler with the edge's error shape and bounds."""

    def __init__(self, manager: EdgeServer, *, edge: EdgeLimits, **kw: Any) -> None:
        super().__init__(manager, keepalive_timeout=edge.head_timeout, **kw)
        self._edge = edge
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        if server is not None and len(server.connections) >= server.bound:
            self._refuse(transport)
            return
        super().connection_made(transport)
        _tune_socket(transport.get_extra_info("socket"), self._edge)

    def _refuse(self, transport: Any) -> None:
        self._refused = True
        # overload, as a full wait line: 429 with Retry-After, which clients back off on
        transport.write(_raw_json_response(P.APIError(
            429, f"the server holds its maximum of {self._manager.bound} connections; "
            "retry shortly", headers={"Retry-After": "1"}, code="rate_limit_exceeded")))
        # Close after the client had a moment to send its request: closing with unread
        # bytes would reset the connection and the client might never read the 429.
        transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            self._manager = None
            return
        super().connection_lost(exc)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Errors raised outside the app's middleware: aiohttp's own parse errors."""
        if request.writer.output_size > 0:  # a response is under way: nothing to answer
            return super().handle_error(request, status, exc, message)
        err = edge_error(exc, self._edge) if exc is not None else None
        if err is None:
            if status >= 500:
                log.error("internal error on a connection", exc_info=exc)
                err = P.APIError(status, "internal server error")
            else:
                err = P.APIError(status, message or "bad request")
        else:
            log.debug("refused a malformed request: %s", err.message)
        resp = _json_response(err)
        resp.force_close()
        return resp


def _tune_socket(sock: socket.socket | None, edge: EdgeLimits) -> None:
    """Find peers that vanished without closing (cable pulled, NAT state dropped)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", edge.keepalive_idle_s),
                        ("TCP_KEEPINTVL", edge.keepalive_interval_s),
                        ("TCP_KEEPCNT", edge.keepalive_probes),
                        ("TCP_USER_TIMEOUT", edge.user_timeout_ms)):
        if hasattr(socket, name):  # Linux; elsewhere the OS defaults apply
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass


class EdgeServer(web.Server):
    """aiohttp's protocol factory, making `EdgeProtocol`s and counting connections."""

    def __init__(self, *args: Any, edge: EdgeLimits, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.edge = edge
        self.bound = edge.connection_bound()

    def __call__(self) -> EdgeProtocol:
        return EdgeProtocol(self, loop=self._loop, edge=self.edge, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An AppRunner whose connections are `EdgeProtocol`s."""

    def __init__(self, app: web.Application, edge: EdgeLimits, **kw: Any) -> None:
        super().__init__(app, **kw)
        self.edge = edge

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return EdgeServer(base.request_handler, request_factory=base.request_factory,
                          handler_cancellation=base.handler_cancellation,
                          loop=asyncio.get_running_loop(), edge=self.edge, **base._kwargs)


# --------------------------------------------------------------------------- the port


class PortTaken(OSError):
    """The port cannot be bound; the message says why and, when visible, who holds it."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not listen: connections are refused until the server is ready) host:port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortTaken(errno.EADDRNOTAVAIL, f"cannot resolve {host}: {exc}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            why += port_holder(port)
        raise PortTaken(exc.errno, f"cannot listen on {host}:{port}: {why}") from None
    sock.setblocking(False)
    return sock
