"""A request whose length is framed twice (both `Transfer-Encoding` and `Content-Length`) is refused, and
its connection closed.

RFC 9112 6.1: the server may reject such a request or read it by Transfer-Encoding alone, but must close
the connection after answering, since a proxy in front may have framed it by the other header (request
smuggling). uvicorn read it by Transfer-Encoding and kept the connection for the next request.
"""

from __future__ import annotations

from typing import Callable

from meshlm.api.errors import APIError

CLOSE = {"Connection": "close"}  # uvicorn closes the connection once a response carrying it is sent


class FramingMiddleware:
    def __init__(self, app, rejected: Callable[[int], None]) -> None:
        """`rejected(status)`: count a request refused here."""
        self.app = app
        self.rejected = rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {k for k, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                self.rejected(400)
                error = APIError(400, "the request has both Transfer-Encoding and Content-Length: send one",
                                 code="ambiguous_framing", headers=CLOSE)
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
