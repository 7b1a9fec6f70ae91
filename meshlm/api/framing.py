"""Requests refused for their head alone, their connection closed.

- Framed twice (both `Transfer-Encoding` and `Content-Length`): RFC 9112 6.1 lets the server reject it or
  read it by Transfer-Encoding alone, but it must close the connection after answering, since a proxy in
  front may have framed it by the other header (request smuggling). uvicorn read it by Transfer-Encoding
  and kept the connection for the next request.
- A head over HEAD_BYTES: h11 refuses one only while it is still arriving past that size, so a larger
  head that came in one read (up to the socket's read size, 256 KiB) was served. Refused whichever way
  it arrived, as the README says.
"""

from __future__ import annotations

from typing import Callable

from meshlm.api.errors import APIError

CLOSE = {"Connection": "close"}  # uvicorn closes the connection once a response carrying it is sent
HEAD_BYTES = 16 * 1024  # uvicorn's cap on a head still arriving (h11_max_incomplete_event_size)


class FramingMiddleware:
    def __init__(self, app, rejected: Callable[[int], None]) -> None:
        """`rejected(status)`: count a request refused here."""
        self.app = app
        self.rejected = rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {k for k, _ in scope["headers"]}
            error = None
            if b"transfer-encoding" in names and b"content-length" in names:
                error = APIError(400, "the request has both Transfer-Encoding and Content-Length: send one",
                                 code="ambiguous_framing", headers=CLOSE)
            elif head_bytes(scope) > HEAD_BYTES:
                error = APIError(400, f"invalid HTTP request: the request line and headers exceed "
                                      f"{HEAD_BYTES // 1024} KiB", code="invalid_http", headers=CLOSE)
            if error is not None:
                self.rejected(400)
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def head_bytes(scope) -> int:
    """About what the request line and headers took on the wire (": " and CRLF included)."""
    target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string") or b"")
    return len(scope["method"]) + target + 12 + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
