"""Who may call the server and from which web origins: the API key check and CORS.

The decisions are plain functions of a request's method, path and headers, so the Flask app
and the forming responder (kipp.http.forming, which answers while a distributed group forms)
apply the same rules. The module imports the standard library only: the forming responder's
child process loads it from beside itself.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Callable

OPEN_PATHS = ("/health", "/metrics")  # open without the API key unless the server closes them
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
DEFAULT_ALLOWED_HEADERS = (
    "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta")
PREFLIGHT_MAX_AGE_S = 600

# (code, message) of the 401 for a request without a key and with a wrong one
KEY_ERRORS = {
    "missing_api_key": "an API key is required: send it as 'Authorization: Bearer KEY' or "
                       "'x-api-key'",
    "invalid_api_key": "the API key is not valid",
}


@dataclass
class Access:
    """kipp serve's --api-key, --protect-health and --cors-origin."""

    api_key: str | None = None  # Bearer or x-api-key; None: open
    protect_info: bool = False  # /health and /metrics need the key too
    cors_origins: tuple[str, ...] = ()  # "*" for any; empty: no CORS headers

    def key_error(self, path: str, header: Callable[[str], str | None]) -> str | None:
        """The code of KEY_ERRORS a request to `path` fails with (`header` reads its headers),
        or None when it may go on. The key is compared in constant time."""
        if self.api_key is None or (path in OPEN_PATHS and not self.protect_info):
            return None
        authorization = header("Authorization") or ""
        given = (authorization[7:].strip() if authorization.lower().startswith("bearer ")
                 else header("x-api-key"))
        if given is None:
            return "missing_api_key"
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return "invalid_api_key"
        return None

    def allowed_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin for a request from `origin`, or None for none."""
        if origin is None or not self.cors_origins:
            return None
        if "*" in self.cors_origins:
            return "*"
        return origin if origin in self.cors_origins else None

    def preflight_headers(self, origin: str | None, requested: str | None) -> dict[str, str]:
        """The headers of the 204 that answers an OPTIONS preflight (none for an origin not
        allowed: the browser then refuses the call)."""
        allowed = self.allowed_origin(origin)
        if allowed is None:
            return {}
        return {"Access-Control-Allow-Origin": allowed, "Vary": "Origin",
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": requested or DEFAULT_ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}
