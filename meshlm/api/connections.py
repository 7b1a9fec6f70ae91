"""Client connections: uvicorn's HTTP/1.1 protocol with deadlines for a silent client.

uvicorn closes a connection left idle after a response (its keep-alive timeout, re-armed by every byte
received), but a new connection that sends nothing, or sends its request head a byte at a time, held
a socket for ever; so did a response the client stopped reading once the kernel's buffers were full
(the response waits in uvicorn's flow control). Enough of them use up the process's file descriptors,
and then the server accepts no one (asyncio logs "socket.accept() out of system resource" and
retries). Here, with `timeout` (--client-timeout):
- each request's head must arrive within `timeout` of connecting or of the last response (closed);
- a response whose writes stay paused for `timeout`, the client reading nothing, is aborted (the
  request then ends as if the client had disconnected);
- a body's pace is read_body's (api/body.py), which answers 408;
- when the server stops, a connection not reading its response, or still sending its request's body,
  is aborted at once (uvicorn would cancel its request at the end of the graceful shutdown, logging it
  as an exception in the app, and answer the second 500).
`AcceptErrors` reports the refused accepts of a server out of descriptors in a line every 30 s.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


# What asyncio's accept loop reports and retries rather than raises (selector_events._accept_connection).
REFUSED_ACCEPT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _QuietTransport:
    """The connection's transport, dropping writes once it is closing. A client that resets a stream makes
    asyncio close the transport at the next send, but uvicorn learns it only when `connection_lost` runs
    on a later turn of the loop: the chunks the stream writes meanwhile (a step's worth of n choices) are
    dropped anyway, and from the sixth on each logs 'WARNING asyncio: socket.send() raised exception.',
    which reads as a fault of the server's sockets."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DeadlineProtocol(H11Protocol):
    def __init__(self, *args: Any, timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout = timeout
        self._head_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_QuietTransport(transport))  # type: ignore[arg-type]
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        for handle in (self._head_deadline, self._write_deadline):
            if handle is not None:
                handle.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.timeout, self._write_overdue)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed head, headers past the size cap, conflicting lengths):
        uvicorn answers it in plain text; here in the error shape every other answer has."""
        body = json.dumps({"error": {"message": f"invalid HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def shutdown(self) -> None:
        # Either request would be cancelled at the end of uvicorn's graceful shutdown, logged as an
        # exception in the app (and a body still arriving answered 500): aborted instead, at once.
        not_reading = self.flow.write_paused  # it cannot take the stream's last event either
        body_arriving = (self.cycle is not None and not self.cycle.response_started
                         and self.conn.their_state is h11.SEND_BODY)  # its request cannot be served any more
        if not_reading or body_arriving:
            self.transport.abort()
        else:
            super().shutdown()

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.timeout, self._head_overdue)

    def _head_overdue(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is in flight: its head arrived (a stalled body is read_body's 408)
        self.transport.close()

    def _write_overdue(self) -> None:
        self._write_deadline = None
        if not self.transport.is_closing():
            self.transport.abort()  # close() would wait for the unread bytes to drain first


class AcceptErrors:
    """The event loop's exception handler: a refused accept (out of file descriptors or memory) in one line.

    asyncio logs every such refusal with a traceback and retries a second later, so a server out of
    descriptors wrote a traceback a second, which reads as a crash. Here the first refusal, and then one
    line per `every` seconds with the count, say what ran out and that clients wait meanwhile; every other
    error goes to asyncio's own handler."""

    def __init__(self, log: logging.Logger, every: float = 30.0) -> None:
        self.log = log
        self.every = every
        self._refused = 0  # since the last line
        self._last: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        retry = getattr(getattr(context.get("handle"), "_callback", None), "__name__", None)
        if isinstance(exc, ValueError) and retry == "_start_serving":
            # asyncio's retry (a second after a refusal) of a listener closed meanwhile: the server stopped
            # while out of descriptors, and there is nothing left to accept on. Not a failure.
            return
        if not (isinstance(exc, OSError) and exc.errno in REFUSED_ACCEPT and "accept" in context.get("message", "")):
            loop.default_exception_handler(context)
            return
        self._refused += 1
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.log.warning("cannot accept connections (%s; open-file limit %d/%d): retrying every second, "
                         "clients wait in the listen backlog (refusals since the last report: %d)",
                         os.strerror(exc.errno), soft, hard, self._refused)
        self._refused, self._last = 0, now
