"""One TCP connection of the control channel: framing, inbound sequence checks,
deadline-bounded I/O and keepalive tuning (pure Python, no MLX).

`control.py` builds the leader/worker protocol on top of these links.
"""

from __future__ import annotations

import select
import selectors
import socket
import time
from collections.abc import Iterable

from meshlm.transport import codec as wire
from meshlm.transport.codec import Frame, Kind, ProtocolError

_RECV_BYTES = 1 << 20
CLOSE_CHECK_S = 0.25  # the longest a wait on a link goes on after the link is closed on this side


class LinkClosed(Exception):
    """The peer closed the connection or the socket failed (control.py turns it into a ControlError)."""


class LinkTimeout(Exception):
    """A deadline passed (control.py turns it into a ControlError)."""


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    """Write all of `data` by `deadline`. Raises TimeoutError when the peer stops reading, OSError when
    the socket fails; what was written before either is unknown, so the connection is done for."""
    view = memoryview(data)
    while view:
        left = remaining(deadline)
        if left == 0:
            raise TimeoutError("send deadline passed")
        sock.settimeout(left)
        view = view[sock.send(view):]


def recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes by `deadline`. Raises TimeoutError, EOFError when the peer closed, or OSError."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = remaining(deadline)
        if left == 0:
            raise TimeoutError("receive deadline passed")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("closed by peer")
        got += k
    return bytes(buf)


def _set_opt(sock: socket.socket, level: int, name: str, value: int) -> None:
    """Set a platform-specific TCP option when this OS has it (Linux and macOS name them differently)."""
    opt = getattr(socket, name, None)
    if opt is None:
        return
    try:
        sock.setsockopt(level, opt, value)
    except OSError:
        pass


def tune(sock: socket.socket, liveness: float, unacked_limit: bool = True) -> None:
    """Low latency for small frames; let the kernel give up on a vanished host (no FIN) within `liveness`.
    `unacked_limit`: also fail a send left unacknowledged that long (Linux's TCP_USER_TIMEOUT), which
    since Linux 5.x includes zero-window probes a busy but live receiver answers: off for links whose
    sends are large and carry their own deadlines."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(liveness / 2))
    _set_opt(sock, socket.IPPROTO_TCP, "TCP_KEEPIDLE", idle)  # Linux
    _set_opt(sock, socket.IPPROTO_TCP, "TCP_KEEPALIVE", idle)  # macOS
    _set_opt(sock, socket.IPPROTO_TCP, "TCP_KEEPINTVL", 1)
    _set_opt(sock, socket.IPPROTO_TCP, "TCP_KEEPCNT", max(1, int(liveness / 2)))
    if unacked_limit:
        _set_opt(sock, socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", int(liveness * 1000))  # Linux: unacked sends fail


class Link:
    """One TCP connection: buffered frame decoding, inbound sequence check, deadline-bounded I/O."""

    def __init__(self, sock: socket.socket, accepts: frozenset[Kind], max_payload: int) -> None:
        self.sock = sock
        # Sends go through a socket object of their own: heartbeat threads send while another thread
        # reads, and a socket object's timeout is one setting, which a read sets to 0 (non-blocking).
        self._out = sock.dup()
        self.accepts = accepts
        self.decoder = wire.FrameDecoder(max_payload)
        self.next_seq = 0  # next sequence number expected from the peer
        self.closed = False
        self.last_heard = time.monotonic()  # when bytes from the peer were last read
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ)
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"

    def send(self, data: bytes, timeout: float) -> None:
        if self.closed:
            raise LinkClosed("connection already closed")
        try:
            self._out.settimeout(max(timeout, 1e-3))
            self._out.sendall(data)
        except socket.timeout:
            raise LinkClosed(f"send blocked for {timeout:.1f} s (peer not reading)") from None
        except OSError as e:
            raise LinkClosed(f"send failed: {e}") from None

    def read_available(self) -> None:
        """Read what the socket holds now (call only when it polled readable)."""
        try:
            self.sock.settimeout(0.0)
            data = self.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise LinkClosed(f"receive failed: {e}") from None
        if not data:
            raise LinkClosed("connection closed by peer")
        self.last_heard = time.monotonic()
        self.decoder.feed(data)

    def next_frame(self) -> Frame | None:
        """A whole buffered frame, checked for kind and sequence, or None."""
        frame = self.decoder.next_frame()
        if frame is None:
            return None
        if frame.kind not in self.accepts:
            raise ProtocolError(f"unexpected {frame.kind.name} frame from {self.peer}")
        if frame.kind is Kind.REJECT:
            return frame  # ends the connection whatever its number; a peer of another build cannot know ours
        if frame.seq != self.next_seq:
            what = "gap (frames lost)" if frame.seq > self.next_seq else "duplicate or replayed frame"
            raise ProtocolError(f"sequence {frame.seq} from {self.peer}, expected {self.next_seq}: {what}")
        self.next_seq += 1
        return frame

    def recv(self, deadline: float) -> Frame:
        """Block until one whole frame arrives; `LinkTimeout` at the deadline, `LinkClosed` on EOF."""
        while (frame := self.next_frame()) is None:
            # In slices: closing the link from another thread (a worker leaving) does not wake an epoll
            # wait on it, which then lasted until the deadline, seconds after the link was gone.
            try:
                ready = not self.closed and self._sel.select(min(remaining(deadline), CLOSE_CHECK_S))
            except (OSError, ValueError):  # closed meanwhile
                ready = False
            if self.closed:
                raise LinkClosed("link closed on this side")
            if not ready and remaining(deadline) == 0:
                # One last read first: a process stopped (SIGSTOP) past its deadline and continued wakes
                # from an interrupted wait with nothing reported, whatever arrived meanwhile.
                self.read_available()
                if (frame := self.next_frame()) is not None:
                    return frame
                raise LinkTimeout()
            self.read_available()
        return frame

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sel.close()
            self.sock.close()
            self._out.close()


def hung_up(link: Link) -> bool:
    """The peer closed or reset `link`'s connection (or the kernel gave up on it: failed keepalives), seen
    without reading: the bytes before the hang-up stay for whoever reads the link. Linux's POLLRDHUP sees
    a peer's FIN even behind unread data; elsewhere only a reset or a hang-up of both directions shows."""
    if link.closed:
        return True
    poller = select.poll()
    poller.register(link.sock, getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR)
    try:
        return bool(poller.poll(0))
    except (OSError, ValueError):  # closed under us
        return True


def wait_readable(links: Iterable[Link], deadline: float) -> list[Link]:
    """Links with bytes (or EOF) to read, waiting at most until `deadline` (0 = just poll)."""
    with selectors.DefaultSelector() as sel:
        for link in links:
            sel.register(link.sock, selectors.EVENT_READ, link)
        return [key.data for key, _ in sel.select(remaining(deadline))]
