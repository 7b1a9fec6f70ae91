"""A lean HTTP/1.1 client for the benchmarks' streamed requests: asyncio streams, kept-alive connections.

Why not httpx: a benchmark's client shares the machine with the servers it measures. httpx spent
~0.5 s of CPU per scaling load (48 streams of 64 SSE chunks), ~150 us per chunk, which on a 2-core
machine is taken from the N ranks but not from the one-core baseline (whose client has the other
core to itself), a bias against the ranks. This client reads the same bytes for a fraction of that.

Only what the benchmarks need: POST (and GET) of a body already encoded, a response framed by
`Transfer-Encoding: chunked` (uvicorn's streams), `Content-Length`, or the connection's close
(http.server's HTTP/1.0 answers, e.g. mlx_lm.server). No TLS, no redirects, no proxies.

Every failure is an `OSError`: `ProtocolError` for a malformed answer, `TimeoutError` when the
request outlives its deadline (the connection is aborted, so a hung server cannot hang the caller).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024  # status line plus headers


class ProtocolError(OSError):
    """The server's answer is not the HTTP/1.1 the client expects."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    _reader: asyncio.StreamReader
    _chunked: bool
    _length: int | None  # None with _chunked False: the body ends when the connection closes
    _done: bool = False

    @property
    def reusable(self) -> bool:
        """The whole body was read and the connection may carry another request."""
        return self._done and (self._chunked or self._length is not None) and \
            self.headers.get("connection", "").lower() != "close"

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        reader = self._reader
        try:
            if self._chunked:
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise ProtocolError("connection closed before the stream's end")
                    try:
                        size = int(size_line.split(b";", 1)[0], 16)
                    except ValueError:
                        raise ProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                    if size == 0:
                        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        break
                    piece = await reader.readexactly(size)
                    if (await reader.readexactly(2)) != b"\r\n":
                        raise ProtocolError("chunk not followed by CRLF")
                    yield piece
            elif self._length is not None:
                left = self._length
                while left > 0:
                    piece = await reader.read(min(left, 65536))
                    if not piece:
                        raise ProtocolError(f"connection closed {left} bytes before the body's end")
                    left -= len(piece)
                    yield piece
            else:
                while piece := await reader.read(65536):
                    yield piece
        except asyncio.IncompleteReadError as e:
            raise ProtocolError(f"connection closed inside a chunk ({len(e.partial)} bytes read)") from None
        self._done = True

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (without their line ends) as they complete; a last unterminated line too."""
        pending = b""
        async for piece in self.pieces():
            pending += piece
            if b"\n" not in piece:
                continue
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])


class Client:
    """Kept-alive connections per (host, port), one request at a time on each; `timeout` bounds a
    whole request (connect, send, and reading its whole answer), `connect_timeout` the connect."""

    def __init__(self, timeout: float | None = 600.0, connect_timeout: float = 10.0):
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, writer in conns:
                writer.close()

    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, body: bytes = b"",
                      content_type: str = "application/json") -> AsyncIterator[Response]:
        """Send one request and yield its response once the headers are in; read the body inside."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http:// URLs: {url!r}")
        key = (parts.hostname, parts.port or 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = (f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nAccept: */*\r\n\r\n").encode("latin-1")
        loop = asyncio.get_running_loop()
        timed_out = False
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            if conn is not None:
                conn[1].transport.abort()

        deadline = loop.call_later(self.timeout, expire) if self.timeout is not None else None
        response: Response | None = None
        try:
            conn, fresh = await self._connection(key)
            try:
                response = await _send(conn, head + body)
            except (ProtocolError, ConnectionError):
                if fresh:
                    raise
                # A kept-alive connection the server closed meanwhile: once more on a new one.
                conn[1].close()
                conn, _ = await self._connection(key, fresh=True)
                response = await _send(conn, head + body)
            yield response
        except OSError as e:
            if timed_out:
                raise TimeoutError(f"no complete answer within {self.timeout} s") from e
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
            if conn is not None:
                if response is not None and response.reusable and not timed_out:
                    self._idle.setdefault(key, []).append(conn)
                else:
                    conn[1].close()

    async def _connection(self, key: tuple[str, int], fresh: bool = False
                          ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], bool]:
        idle = self._idle.get(key)
        if idle and not fresh:
            return idle.pop(), False
        try:
            conn = await asyncio.wait_for(asyncio.open_connection(*key, limit=MAX_HEADER_BYTES),
                                          self.connect_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"connect to {key[0]}:{key[1]} took over {self.connect_timeout} s") from None
        return conn, True


async def _send(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], data: bytes) -> Response:
    conn[1].write(data)
    await conn[1].drain()
    return await _read_head(conn[0])


async def _read_head(reader: asyncio.StreamReader) -> Response:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("connection closed before the response's headers"
                            if not e.partial else "connection closed inside the response's headers") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"response headers over {MAX_HEADER_BYTES} bytes") from None
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise ProtocolError(f"bad status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None
    if not chunked and "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise ProtocolError(f"bad Content-Length {headers['content-length']!r}") from None
    return Response(int(rest[:3]), headers, reader, chunked, length)
