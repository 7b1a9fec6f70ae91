"""Client connections: uvicorn's HTTP/1.1 protocol with a deadline for each request's head.

uvicorn closes a connection left idle after a response (its keep-alive timeout, re-armed by every byte
received), but a new connection that sends nothing, or sends its request head a byte at a time, holds
a socket for ever. Enough of them use up the process's file descriptors, and then the server accepts
no one (asyncio logs "socket.accept() out of system resource" and retries). Here a connection must
deliver each request's head within the deadline of connecting or of its last response; a body's pace
is read_body's (api/body.py), which answers 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadlineProtocol(H11Protocol):
    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_overdue)

    def _head_overdue(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is in flight: its head arrived (a stalled body is read_body's 408)
        self.transport.close()
