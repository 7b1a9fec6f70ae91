"""`--api-key`: every API route wants `Authorization: Bearer <key>` (as vLLM's `--api-key` and OpenAI's own);
`/health`, `/metrics` and `/version` stay open for probes and scrapers, and so do CORS preflights (a
browser sends them without credentials).

A pure ASGI layer, so streamed responses pass through untouched; the key is compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Callable

from meshlm.api.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class APIKeyMiddleware:
    def __init__(self, app, key: str, rejected: Callable[[int], None]) -> None:
        """`rejected(status)`: count a request refused here."""
        self.app = app
        self.expected = key.encode()
        self.rejected = rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        # The scheme is case-insensitive (RFC 9110 11.1): a client sending "bearer" was refused.
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials, self.expected):
            return await self.app(scope, receive, send)
        self.rejected(401)
        error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
