"""The HTTP listening socket, bound before anything loads.

uvicorn binds its port only once the app starts, i.e. after the model (and every rank of a cluster)
has loaded: a port already taken, or a --host that does not resolve, failed minutes into a big start
with uvicorn's `[Errno 98] ... address already in use` and status 3. Bound first, the same mistakes
are a one-line error before the load, and the port is held meanwhile (--port 0 gets a free one, which
the log then names).
"""

from __future__ import annotations

import errno
import socket


class ListenError(ValueError):
    """The server cannot listen where it was told to; the message says why and what to change."""


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host:port` (uvicorn listens on it); raises ListenError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ListenError(f"--host {host!r} is not an address this machine can listen on: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    family, kind, proto, _, address = infos[0]
    # The protocol number matters: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is
    # IPPROTO_TCP, and with it on, a response written in two pieces waits for the client's delayed ACK:
    # ~40 ms on every request after the first on a kept-alive connection.
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn binds: a restart may reuse the port while old connections linger in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (another server there? choose another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock
