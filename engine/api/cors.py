"""CORS and request ids: the response headers every answer of the server gets.

CORS follows vLLM's flags (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
`--allow-credentials`; each list defaults to ["*"] as vLLM's) and Starlette's
CORSMiddleware, which vLLM uses: a preflight (OPTIONS with Access-Control-Request-Method)
is answered 200 with what is allowed, or 400 when the origin, method or a header is not;
any other request from an allowed origin gets Access-Control-Allow-Origin on its answer.

X-Request-Id: taken from the request when it sends one (printable, at most 128
characters), else made; returned on the answer and written in the server's log lines
about that request.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_SAFE_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


def request_id(sent: str | None) -> str:
    """The request's id: the client's X-Request-Id when it is sane, else a new one."""
    if sent and _SAFE_ID.match(sent):
        return sent
    return os.urandom(16).hex()


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def _origin_ok(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def _allow_origin(self, origin: str) -> str:
        # a wildcard with credentials must echo the origin (browsers refuse "*" then)
        if "*" in self.allowed_origins and not self.allow_credentials:
            return "*"
        return origin

    def preflight(self, origin: str, method: str, headers: str) -> tuple[int, dict[str, str]]:
        """The status and headers of the answer to a preflight request."""
        out = {"Vary": "Origin"}
        methods = _ALL_METHODS if "*" in self.allowed_methods else ", ".join(self.allowed_methods)
        out["Access-Control-Allow-Methods"] = methods
        out["Access-Control-Max-Age"] = "600"
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        asked = [h.strip().lower() for h in headers.split(",") if h.strip()]
        if "*" in self.allowed_headers:
            if asked:
                out["Access-Control-Allow-Headers"] = ", ".join(asked)
        else:
            out["Access-Control-Allow-Headers"] = ", ".join(self.allowed_headers)
        wanted = {h.lower() for h in self.allowed_headers}
        ok = (self._origin_ok(origin)
              and ("*" in self.allowed_methods or method.upper() in
                   {m.upper() for m in self.allowed_methods})
              and ("*" in wanted or all(h in wanted for h in asked)))
        if not ok:
            return 400, out
        out["Access-Control-Allow-Origin"] = self._allow_origin(origin)
        return 200, out

    def simple(self, origin: str) -> dict[str, str]:
        """Headers for the answer to a non-preflight request from `origin`."""
        if not self._origin_ok(origin):
            return {}
        out = {"Access-Control-Allow-Origin": self._allow_origin(origin)}
        if out["Access-Control-Allow-Origin"] != "*":
            out["Vary"] = "Origin"
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out
