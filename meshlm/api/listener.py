"""The HTTP listening socket, bound before anything loads.

uvicorn binds its port only once the app starts, i.e. after the model (and every rank of a cluster)
has loaded: a port already taken, or a --host that does not resolve, failed minutes into a big start
with uvicorn's `[Errno 98] ... address already in use` and status 3. Bound first, the same mistakes
are a one-line error before the load (--port 0 gets a free one, which the log then names). A server
started beside this one while both load is refused later, when it would listen (`listen`).
"""

from __future__ import annotations

import errno
import os
import socket


LISTEN_BACKLOG = 2048  # uvicorn's default (it listens again on the socket with its own)


class ListenError(ValueError):
    """The server cannot listen where it was told to; the message says why and what to change."""


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host:port` (`listen`, then uvicorn serves on it); raises ListenError."""
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
        raise _listen_error(host, port, exc) from None
    return sock


def listen(sock: socket.socket, host: str, port: int) -> None:
    """Listen on a socket from `bind`, once the server can answer; raises ListenError.

    Only now is the port really held: Linux lets two SO_REUSEADDR sockets bind one port while neither
    listens, so a second server started beside one still loading gets past `bind` and is refused here,
    after its own load. It used to die in uvicorn's listen with a traceback. Listening any earlier would
    queue connections the server cannot answer yet, and a TCP health check would call it up."""
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        raise _listen_error(host, port, exc) from None


def _listen_error(host: str, port: int, exc: OSError) -> ListenError:
    return ListenError(f"cannot listen on {host}:{port}: {listen_failure(exc, '--port')}")


def listen_failure(exc: OSError, flag: str, who: str = "server") -> str:
    """Why a socket could not bind or listen, and for a taken port which flag picks another (the HTTP port,
    the cluster's control and stage ports). asyncio's bind errors repeat the address in their strerror, so
    a system error is named by its number; a resolver's (a negative number) keeps its own words."""
    if exc.errno is not None and exc.errno > 0:
        why = os.strerror(exc.errno)
    else:
        why = (exc.strerror or str(exc)).split(" (while attempting")[0]
    return why + (f" (another {who} there? choose another {flag})" if exc.errno == errno.EADDRINUSE else "")
