"""The benchmarks' lean HTTP client (benchmarks/_http.py) against a scripted server on 127.0.0.1:
every framing it must read, kept-alive connections, and failures as OSErrors, never a hang."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _http  # noqa: E402

SSE = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def serve(answers: list[bytes], close_after: bool = False, linger: float = 0.0):
    """A server that reads one request per answer on each connection and writes the next answer,
    closing the connection after each answer (`close_after`) or after the last (`linger` s later);
    returns (url, the requests it read, the connections it accepted)."""
    requests: list[bytes] = []
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                requests.append(head + await reader.readexactly(length))
                writer.write(answers.pop(0))
                await writer.drain()
                if close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        await asyncio.sleep(linger)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", requests, connections


async def lines_of(client: _http.Client, url: str) -> tuple[int, list[str]]:
    async with client.request("POST", url + "/v1/x", b'{"q": 1}') as r:
        return r.status, [line async for line in r.lines()]


def test_chunked_answers_keep_the_connection() -> None:
    async def main() -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE[:7], SSE[7:20], SSE[20:])
        server, url, requests, connections = await serve([answer, answer])
        async with _http.Client(timeout=5) as client:
            for _ in range(2):
                status, lines = await lines_of(client, url)
                assert status == 200
                assert lines == ['data: {"a": 1}', "", "data: [DONE]", ""]
        server.close()
        assert connections[0] == 1
        assert requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and requests[0].endswith(b'\r\n\r\n{"q": 1}')

    asyncio.run(main())


def test_content_length_and_close_delimited_answers() -> None:
    async def main() -> None:
        fixed = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope!"
        server, url, _, _ = await serve([fixed])
        async with _http.Client(timeout=5) as client:
            async with client.request("POST", url + "/v1/x", b"{}") as r:
                assert (r.status, await r.read()) == (404, b"nope!")
        server.close()

        # http.server's HTTP/1.0 streams (mlx_lm.server): the body ends when the server closes.
        server, url, _, connections = await serve([b"HTTP/1.0 200 OK\r\n\r\n" + SSE, b"HTTP/1.0 200 OK\r\n\r\nx"],
                                                  close_after=True)
        async with _http.Client(timeout=5) as client:
            assert (await lines_of(client, url))[1][-2:] == ["data: [DONE]", ""]
            assert (await lines_of(client, url))[1] == ["x"]
        server.close()
        assert connections[0] == 2

    asyncio.run(main())


def test_a_connection_the_server_closed_is_replaced() -> None:
    async def main() -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        server, url, _, connections = await serve([answer, answer], close_after=True)
        async with _http.Client(timeout=5) as client:
            assert (await lines_of(client, url))[1] == ["ok"]
            await asyncio.sleep(0.05)  # the server has closed the kept-alive connection
            assert (await lines_of(client, url))[1] == ["ok"]
        server.close()
        assert connections[0] == 2

    asyncio.run(main())


@pytest.mark.parametrize("answer, message", [
    (b"SPDY/3 200 OK\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nshort", "inside a chunk"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "before the body's end"),
    (b"HTTP/1.1 200 OK\r\nContent-Len", "inside the response's headers"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "before the stream's end"),
])
def test_malformed_answers_are_protocol_errors(answer: bytes, message: str) -> None:
    async def main() -> None:
        server, url, _, _ = await serve([answer], close_after=True)
        async with _http.Client(timeout=5) as client:
            with pytest.raises(_http.ProtocolError, match=message):
                await lines_of(client, url)
        server.close()

    asyncio.run(main())


def test_a_server_that_stops_answering_times_out() -> None:
    async def main() -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n"  # then silence
        server, url, _, _ = await serve([answer], linger=3.0)
        async with _http.Client(timeout=0.3) as client:
            with pytest.raises(TimeoutError, match="within 0.3 s"):
                await asyncio.wait_for(lines_of(client, url), 5)
        server.close()

    asyncio.run(main())
