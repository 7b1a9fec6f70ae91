"""Requests a shutdown's drain waits for: every POST from its arrival to its last byte.

A request is on its way to the engine before it is queued there (its body read and validated, its chat
template rendered, its grammar compiled: seconds, for some). On SIGTERM the engine refused those at
submit with a 503, though they came before the signal, and a request still being prepared when the
grace ran out was cancelled by uvicorn: a plain-text 500 and a traceback. Admitted here, a request that
arrived before the drain is queued and served within the grace like those already running; one that
arrives during it is refused at once, with the drain's JSON 503.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from meshlm.api.errors import APIError


class AdmissionMiddleware:
    def __init__(self, app, admit: Callable[[], bool], release: Callable[[], None],
                 stopping: Callable[[], bool], rejected: Callable[[int], None]) -> None:
        """`admit()`: False when the server is draining (the request is refused); `release()` once answered;
        `stopping()`: the server is shutting down; `rejected(status)`: count a request refused here."""
        self.app, self.admit, self.release, self.stopping, self.rejected = app, admit, release, stopping, rejected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if not self.admit():
            self.rejected(503)
            return await _shutting_down().response()(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.stopping():
                raise
            # uvicorn's graceful shutdown ran out on a request still being prepared past the drain (a chat
            # template that renders for seconds): its answer is the drain's 503, not uvicorn's bare 500
            self.rejected(503)
            await _shutting_down().response()(scope, receive, send)
        finally:
            self.release()


def _shutting_down() -> APIError:
    return APIError(503, "server shutting down", type_="server_error", code="unavailable",
                    headers={"Retry-After": "5"})
