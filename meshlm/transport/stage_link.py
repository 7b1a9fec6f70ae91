"""The connection between neighbouring pipeline stages: activations (and KV packets) in the stage wire
format (transport/stage_wire.py), over one TCP connection kept open for the cluster's life.

The seed design opens a connection per hop per step; the packets here are the
same, but a handshake per step would cost more than a decode step's payload,
so the connection stays open. Stage s connects to stage s+1, which listens.

Handshake (all integers big-endian, like the stage wire format), each message
read within the handshake deadline:
1. connecting -> accepting: b"MLST", u32 link version, i32 stage_from, i32 stage_to, 32-byte nonce;
2. accepting -> connecting: 32-byte nonce, 32-byte proof (auth.stage_proof, accepting end);
3. connecting -> accepting: 32-byte proof (connecting end).
Each side checks the other's proof of the cluster secret over both nonces and
the stage pair, so only a rank of this cluster can feed a stage activations,
and a stage only takes them from the neighbour it expects. As on the control
channel, the secret decides who connects; it does not protect the bytes that follow.

After the handshake every read and write has a deadline; a peer that closes,
stalls or sends a packet that is not the one expected is a `StageLinkError`
naming the stage, which ends the step (and the cluster) like any rank failure.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from meshlm.transport import stage_wire
from meshlm.transport.auth import ClusterSecret, new_nonce, proof_matches, stage_proof
from meshlm.transport.codec import ControlError
from meshlm.config import split_addr
from meshlm.transport.handshakes import HandshakeSlots, RefusalLog, host_key
from meshlm.transport.link import recv_exactly, remaining, send_all, tune

log = logging.getLogger(__name__)

MAGIC = b"MLST"
LINK_VERSION = 1
_HELLO = struct.Struct("!4sIii32s")
NONCE, PROOF = 32, 32
# In place of the listener's nonce and proof: a verdict (another stage pair, another build), the reason
# after it. The connecting stage fails at once, where a bare close would have it retry until its deadline.
REFUSED = b"MLST-REFUSED\x00"
RETRY_SECONDS = 0.1
# How long one accepted connection has to complete its side of the handshake (a neighbour's takes a
# round trip). Handshakes run side by side, a few per host: one at a time, five silent strangers (the
# listen backlog) held a real neighbour back 25 s, and a flood of them until the start deadline.
HANDSHAKE_SECONDS = 5.0
HANDSHAKES_PER_HOST = 4
HANDSHAKES = 32
BACKLOG = 64


class StageLinkError(ControlError):
    """A stage link failed: closed, timed out, refused, or a packet that is not the expected one."""


@dataclass(frozen=True)
class ActivationSpec:
    """What an activation between two stages must look like: (1, tokens, hidden) of the model's dtype."""

    hidden_size: int
    dtype: mx.Dtype


class StageLink:
    def __init__(self, sock: socket.socket, own: int, peer: int, liveness: float) -> None:
        self.sock = sock
        self.own, self.peer = own, peer
        # No unacked-send limit: an activation larger than the socket buffers waits in zero-window probes
        # while the next stage computes another micro-batch, which may take longer than --worker-timeout
        # (the limit reset healthy links then). Each send and read has its step deadline; a stage that
        # dies is the control channel's to notice.
        tune(sock, liveness, unacked_limit=False)
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- packets ----------------------------------------------------------------------
    def send_activation(self, step: int, pos: int, hidden: mx.array, timeout: float) -> None:
        self.send(stage_wire.encode_activation(self.own, self.peer, step, pos, hidden), timeout)

    def recv_activation(self, step: int, pos: int, tokens: int, spec: ActivationSpec, timeout: float) -> mx.array:
        """The previous stage's hidden states for `step`: validated against everything expected."""
        expect = stage_wire.Expect(
            stage_from=self.peer, stage_to=self.own, step=step, pos=pos,
            tensors=(stage_wire.TensorExpect(spec.dtype, (1, tokens, spec.hidden_size)),
                     stage_wire.TensorExpect(required=False)),
            max_bytes=tokens * spec.hidden_size * spec.dtype.size + (1 << 20))
        deadline = time.monotonic() + timeout
        try:
            _, (hidden, _mask) = stage_wire.read_packet(lambda n: self._recv_exactly(n, deadline), expect)
        except stage_wire.StageWireError as exc:
            raise StageLinkError(f"stage {self.peer} sent a bad activation packet: {exc}") from None
        # A well-formed packet of NaN (a broken or hostile stage) gave 200s of end-of-text tokens, and the
        # next stages cached that KV, in RAM and on the SSD tier, for later requests after a restart too
        if not mx.all(mx.isfinite(hidden)).item():
            raise StageLinkError(f"stage {self.peer} sent activations that are not finite (NaN or infinity) for "
                                 f"step {step}")
        return hidden

    # -- bytes --------------------------------------------------------------------------
    def send(self, data: bytes, timeout: float) -> None:
        try:
            send_all(self.sock, data, time.monotonic() + timeout)
        except TimeoutError as exc:
            if exc.errno == errno.ETIMEDOUT:  # the kernel's, not the deadline's: say so, not "after 60 s"
                raise StageLinkError(f"link to stage {self.peer} failed: {exc}") from None
            raise StageLinkError(f"sending to stage {self.peer} timed out after {timeout:.1f} s") from None
        except OSError as exc:
            raise StageLinkError(f"link to stage {self.peer} failed: {exc}") from None
        self.bytes_sent += len(data)

    def _recv_exactly(self, n: int, deadline: float) -> bytes:
        try:
            data = recv_exactly(self.sock, n, deadline)
        except TimeoutError as exc:
            if exc.errno == errno.ETIMEDOUT:  # the kernel gave up on the connection
                raise StageLinkError(f"link from stage {self.peer} failed: {exc}") from None
            raise StageLinkError(f"stage {self.peer} sent nothing for the step in time") from None
        except EOFError:
            raise StageLinkError(f"stage {self.peer} closed the link") from None
        except OSError as exc:
            raise StageLinkError(f"link from stage {self.peer} failed: {exc}") from None
        self.bytes_received += n
        return data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- forming a link ---------------------------------------------------------------------------

def listen(host: str, port: int) -> socket.socket:
    """The accepting stage's socket, opened before the cluster forms so a neighbour can connect early."""
    # An IPv6 address ("ips" of a hostfile) too, as the control channel's listener takes it
    srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(BACKLOG)
    return srv


def accept(server: socket.socket, secret: ClusterSecret, own: int, peer: int, timeout: float,
           liveness: float) -> StageLink:
    """Take the link from stage `peer` (= own - 1). Every connection gets its handshake on a thread of its
    own, within HANDSHAKE_SECONDS and the slots of its host; those that fail are dropped (and logged),
    and the wait goes on until the deadline."""
    deadline = time.monotonic() + timeout
    slots = HandshakeSlots(HANDSHAKES_PER_HOST, HANDSHAKES)
    # The last three refusals name themselves in the deadline's message, the rest are counted
    refusals = RefusalLog(log, f"stage {own}: dropped a connection from %s to its stage link: %s", keep=3)
    proven: queue.Queue = queue.Queue()
    lock = threading.Lock()
    taken = threading.Event()  # set once accept returns: handshakes still running close their sockets
    running: list[threading.Thread] = []

    def handshake(sock: socket.socket, host: str, where: str) -> None:
        try:
            _accept_handshake(sock, secret, own, peer, min(deadline, time.monotonic() + HANDSHAKE_SECONDS))
        except (StageLinkError, OSError) as exc:
            refusals.refused(where, str(exc))
            sock.close()
            return
        finally:
            slots.release(host)
        with lock:
            if not taken.is_set():
                proven.put(sock)
                return
        sock.close()

    try:
        while True:
            left = remaining(deadline)
            if left == 0:
                for t in running:  # their deadlines are this one: let them finish, or say why they failed
                    t.join(0.2)
            try:
                sock = proven.get_nowait()
            except queue.Empty:
                pass
            else:
                try:
                    return StageLink(sock, own, peer, liveness)
                except OSError as exc:
                    sock.close()
                    raise StageLinkError(f"link from stage {peer} failed: {exc}") from None
            if left == 0:
                latest = refusals.latest()
                seen = f" (refused {refusals.count}: {'; '.join(latest)})" if latest else ""
                raise StageLinkError(f"stage {peer} did not connect to stage {own} within {timeout:.0f} s{seen}")
            server.settimeout(min(left, 0.05))
            try:
                sock, addr = server.accept()
            except (TimeoutError, socket.timeout):
                continue
            where, host = f"{addr[0]}:{addr[1]}", host_key(addr[0])
            if not slots.take(host):
                refusals.refused(where, "too many connections still to prove themselves")
                sock.close()
                continue
            running[:] = [t for t in running if t.is_alive()]
            running.append(threading.Thread(target=handshake, args=(sock, host, where),
                                            name=f"meshlm-stage{own}-handshake", daemon=True))
            running[-1].start()
    finally:
        with lock:
            taken.set()
        while not proven.empty():  # a second proven peer (none is expected): not this link
            proven.get_nowait().close()
        refusals.close()


def connect(addr: str, secret: ClusterSecret, own: int, peer: int, timeout: float, liveness: float) -> StageLink:
    """Connect to stage `peer` (= own + 1) at host:port, retrying until it listens or the deadline: also
    when the listener drops the connection during the handshake (its slots were full: strangers may hold
    them for a while), not when it fails to prove the secret or refuses the link (another stage pair or
    build)."""
    host, port = split_addr(addr)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, remaining(deadline)))
            try:
                _connect_handshake(sock, secret, own, peer, deadline)
                return StageLink(sock, own, peer, liveness)
            except BaseException:
                sock.close()
                raise
        except (OSError, _Dropped) as exc:
            if remaining(deadline) == 0:
                raise StageLinkError(f"stage {own} cannot reach stage {peer} at {addr}: {exc}") from None
            time.sleep(min(RETRY_SECONDS, remaining(deadline)))


def _pair(stage_from: int, stage_to: int) -> bytes:
    return struct.pack("!ii", stage_from, stage_to)


def _accept_handshake(sock: socket.socket, secret: ClusterSecret, own: int, peer: int, deadline: float) -> None:
    magic, version, stage_from, stage_to, their_nonce = _HELLO.unpack(_read(sock, _HELLO.size, deadline))
    if magic != MAGIC:
        raise StageLinkError("not a meshlm stage link")
    verdict = told = None
    if version != LINK_VERSION:
        verdict = f"speaks stage link version {version}, this build speaks {LINK_VERSION}"
        told = f"it speaks link version {LINK_VERSION}"
    elif (stage_from, stage_to) != (peer, own):
        verdict = f"claims to link stage {stage_from} to {stage_to}; stage {own} takes only stage {peer}"
        told = f"it takes only stage {peer}"
    if verdict is not None:  # a stage of this or another build: tell it (in 51 bytes), waiting cannot help
        with contextlib.suppress(StageLinkError, OSError):
            reply = REFUSED + told.encode()[:NONCE + PROOF - len(REFUSED)]
            _write(sock, reply.ljust(NONCE + PROOF, b"\0"), deadline)
        raise StageLinkError(verdict)
    nonce = new_nonce()
    link = _pair(peer, own)
    _write(sock, nonce + stage_proof(secret, True, nonce, their_nonce, link), deadline)
    if not proof_matches(stage_proof(secret, False, their_nonce, nonce, link), _read(sock, PROOF, deadline)):
        raise StageLinkError("did not prove it holds the cluster secret")


def _connect_handshake(sock: socket.socket, secret: ClusterSecret, own: int, peer: int, deadline: float) -> None:
    nonce = new_nonce()
    _write(sock, _HELLO.pack(MAGIC, LINK_VERSION, own, peer, nonce), deadline)
    reply = _read(sock, NONCE + PROOF, deadline)
    if reply.startswith(REFUSED):
        why = reply[len(REFUSED):].rstrip(b"\0").decode(errors="replace")
        raise StageLinkError(f"stage {peer} refused the link from stage {own}: {why}")
    their_nonce, proof = reply[:NONCE], reply[NONCE:]
    link = _pair(own, peer)
    if not proof_matches(stage_proof(secret, True, their_nonce, nonce, link), proof):
        raise StageLinkError(f"the listener for stage {peer} did not prove it holds the cluster secret")
    _write(sock, stage_proof(secret, False, nonce, their_nonce, link), deadline)


class _Dropped(StageLinkError):
    """The other end closed the connection during the handshake (or never answered in time)."""


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    try:
        return recv_exactly(sock, n, deadline)
    except TimeoutError:
        raise _Dropped("handshake timed out") from None
    except EOFError:
        raise _Dropped("closed during the handshake") from None


def _write(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(0.01, remaining(deadline)))
    try:
        sock.sendall(data)
    except (TimeoutError, socket.timeout):
        raise StageLinkError("handshake timed out") from None
