"""The HTTP listening socket: what uvicorn's asyncio server makes of the connections it accepts."""

from __future__ import annotations

import asyncio
import socket

import pytest

from meshlm.api import listener


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_accepted_connections_have_nagle_off(host):
    # With Nagle on, a response written as headers then body waits for the client's delayed ACK (~40 ms)
    # on every request after the first on a kept-alive connection.
    sock = listener.bind(host, 0)
    assert sock.proto == socket.IPPROTO_TCP

    async def accept_one() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(accept_one()) != 0


def test_a_taken_port_is_a_sentence():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(listener.ListenError, match="another server there"):
            listener.bind("127.0.0.1", taken.getsockname()[1])


def test_a_second_server_bound_while_the_first_loads_is_refused_when_it_would_listen():
    """Regression: Linux lets two SO_REUSEADDR sockets bind one port while neither listens, so a second server
    on the same --port got past `bind`, loaded, said it served, then died in uvicorn's listen with a traceback.
    Now `listen` (called before serving) refuses it in a sentence; while loading, neither accepts a client."""
    first = listener.bind("127.0.0.1", 0)
    second = listener.bind("127.0.0.1", first.getsockname()[1])
    try:
        with pytest.raises(ConnectionRefusedError):  # nothing listens while the servers load
            socket.create_connection(first.getsockname(), timeout=5).close()
        listener.listen(first, "127.0.0.1", first.getsockname()[1])
        with pytest.raises(listener.ListenError, match="another server there"):
            listener.listen(second, "127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
        second.close()


def test_a_failure_to_listen_is_named_once_for_every_listener():
    """The HTTP, control and stage listeners say why in one way. The control channel's used to name a
    resolver's error by its negative number ('Unknown error -2')."""
    import errno

    resolver = OSError(-2, "Name or service not known (while attempting to bind on address ('x', 1))")
    assert listener.listen_failure(resolver, "--control-port", "cluster") == "Name or service not known"
    taken = OSError(errno.EADDRINUSE, "error while attempting to bind on address ('x', 1): address already in use")
    assert listener.listen_failure(taken, "--stage-port", "cluster") == \
        "Address already in use (another cluster there? choose another --stage-port)"
