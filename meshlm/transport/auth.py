"""Who may join a cluster: the cluster secret, and the handshake that proves it on both ends
(HMAC-SHA256; pure Python, no MLX).

Only a process that holds the secret can join a cluster as a worker, and a
worker obeys only a leader that proves it holds the same secret. Each proof
covers both sides' fresh nonces, so a recorded handshake cannot be replayed,
and a domain tag per direction, so one side's proof is never valid as the
other's. The secret never leaves the process except through a child's
environment: `ClusterSecret` redacts itself in every repr and str.

Handshake (frames in `codec`): the leader sends CHALLENGE(nonce_l) on accept
and the worker sends HELLO(rank, world size, nonce_w) on connect, neither
waiting for the other; the worker answers the challenge with
PROOF(hello_proof); the leader admits it if the proof matches, and once every
rank is in sends each worker WELCOME(world size, welcome_proof).
After that no frame is authenticated: the secret decides who joins, it does
not protect the connection from someone on the network path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from meshlm.transport import codec as wire
from meshlm.transport.codec import (MAC_SIZE, NONCE_SIZE, Challenge, ControlError, Frame, Hello, Kind, Proof,
                                    ProtocolError, VersionMismatch, Welcome)
from meshlm.transport.link import Link, LinkClosed, LinkTimeout

SECRET_ENV = "MESHLM_CLUSTER_SECRET"
MIN_SECRET_CHARS = 32  # 16 random bytes written as hex
_HELLO_TAG = b"meshlm-hello\x00"
_WELCOME_TAG = b"meshlm-welcome\x00"
assert hashlib.sha256().digest_size == MAC_SIZE


class ClusterSecret:
    """The shared key of one cluster. Its repr and str are redacted, so a log line or a dataclass
    repr that holds one cannot leak it; `reveal()` is for a child rank's environment only."""

    __slots__ = ("_text",)

    def __init__(self, text: str, source: str = "the cluster secret") -> None:
        """Raises ValueError naming `source` (never the value) when `text` is too short to be a secret."""
        if not isinstance(text, str):
            raise ValueError(f"{source} must be a string, not {type(text).__name__}")
        if len(text) < MIN_SECRET_CHARS:
            raise ValueError(f"{source} is {len(text)} characters long; a cluster secret needs at least "
                             f"{MIN_SECRET_CHARS} (generate one with `openssl rand -hex 32`)")
        self._text = text

    @classmethod
    def generate(cls) -> ClusterSecret:
        """A fresh random secret (256 bits), for a cluster whose ranks this process starts itself."""
        return cls(secrets.token_hex(32))

    def reveal(self) -> str:
        return self._text

    def key(self) -> bytes:
        return self._text.encode("utf-8", "surrogatepass")

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    def __copy__(self) -> ClusterSecret:
        return self  # immutable

    def __deepcopy__(self, memo: dict) -> ClusterSecret:
        return self

    def __reduce__(self) -> tuple:
        raise TypeError("a ClusterSecret is never serialized")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def _mac(secret: ClusterSecret, *parts: bytes) -> bytes:
    h = hmac.new(secret.key(), digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def hello_proof(secret: ClusterSecret, leader_nonce: bytes, hello_payload: bytes) -> bytes:
    """The worker's PROOF: it holds the secret, answering this leader's challenge, for exactly these
    HELLO claims (the payload holds rank, world size and the worker's nonce)."""
    return _mac(secret, _HELLO_TAG, leader_nonce, hello_payload)


def welcome_proof(secret: ClusterSecret, worker_nonce: bytes, leader_nonce: bytes, welcome_fields: bytes) -> bytes:
    """The leader's proof in WELCOME: it holds the secret, for this worker's nonce and these fields."""
    return _mac(secret, _WELCOME_TAG, worker_nonce, leader_nonce, welcome_fields)


_STAGE_ACCEPT_TAG = b"meshlm-stage-accept\x00"
_STAGE_CONNECT_TAG = b"meshlm-stage-connect\x00"


def stage_proof(secret: ClusterSecret, accepting: bool, own_nonce: bytes, peer_nonce: bytes, link: bytes) -> bytes:
    """One end's proof on a pipeline stage link (transport/stage_link.py): it holds the secret, for
    both nonces and this link's (from, to) stages; a tag per end, so neither proof is valid as the other."""
    return _mac(secret, _STAGE_ACCEPT_TAG if accepting else _STAGE_CONNECT_TAG, own_nonce, peer_nonce, link)


_PREFILL_ACCEPT_TAG = b"meshlm-prefill-accept\x00"
_PREFILL_CONNECT_TAG = b"meshlm-prefill-connect\x00"


def prefill_proof(secret: ClusterSecret, accepting: bool, own_nonce: bytes, peer_nonce: bytes) -> bytes:
    """One end's proof on a disaggregated-prefill connection (disagg/prefill_wire.py): it holds the secret,
    for both nonces; a tag per end, and tags no other link uses, so no proof is valid anywhere else."""
    return _mac(secret, _PREFILL_ACCEPT_TAG if accepting else _PREFILL_CONNECT_TAG, own_nonce, peer_nonce)


def proof_matches(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison, so the time taken says nothing about how much of a forgery was right."""
    return hmac.compare_digest(expected, got)


# -- the handshake, both ends -----------------------------------------------------------


class HandshakeError(ControlError):
    """The cluster could not form: missing ranks, mismatched model or version, bad rank numbering, or rejected."""


class Refused(Exception):
    """Leader side: a connection that did not prove it holds the secret (a stranger, or a rank with another
    secret). It is dropped and the leader keeps waiting; the message names neither the secret nor a proof."""


# The leader's REJECT to an unproven connection it dropped to make room: not a verdict on the worker,
# which tries again (strangers flooding the control port evicted a real worker, and the start failed).
BUSY = "too many unauthenticated connections"


class LeaderBusy(HandshakeError):
    """The leader dropped this connection before it could prove itself: its slots were full."""


@dataclass
class Candidate:
    """Leader side: one accepted connection that has not proved itself yet. Nothing it claims is believed
    (nor checked against the cluster) until its PROOF matches."""

    link: Link
    deadline: float  # dropped if it has not proved itself by then
    host: str = ""  # the address it connected from (slots are bounded per host)
    nonce: bytes = field(default_factory=new_nonce, repr=False)
    hello: Hello | None = None
    hello_payload: bytes = field(default=b"", repr=False)

    def challenge(self) -> bytes:
        """CHALLENGE (seq 0), sent on accept before anything is read, so a peer of another build sees our
        version in its first frame."""
        return wire.encode_frame(Kind.CHALLENGE, 0, wire.encode(Challenge(self.nonce)))

    def authenticate(self, secret: ClusterSecret) -> Hello | None:
        """Read what arrived: the HELLO once its PROOF matches, None while frames are still due.

        Raises Refused, ProtocolError or LinkClosed (drop it) or VersionMismatch (a peer of another
        build).
        """
        self.link.read_available()
        while (frame := self.link.next_frame()) is not None:
            if frame.kind is Kind.REJECT:
                # Anyone can send one: unproven, it ends nothing but this connection (so does a frame of
                # another version, VersionMismatch: a rank of another build, told why in its own version).
                reason = repr(wire.decode_reason(frame.payload)[:200])
                raise Refused(f"it refused the leader before proving it holds the secret, saying {reason}")
            if self.hello is None:
                if frame.kind is not Kind.HELLO:
                    raise ProtocolError(f"first frame was {frame.kind.name}, expected HELLO")
                self.hello, self.hello_payload = wire.decode(Kind.HELLO, frame.payload), frame.payload
            elif frame.kind is not Kind.PROOF:
                raise ProtocolError(f"{frame.kind.name} instead of PROOF")
            elif proof_matches(hello_proof(secret, self.nonce, self.hello_payload), wire.decode(Kind.PROOF, frame.payload).mac):
                return self.hello
            else:
                raise Refused("authentication failed: no proof of the cluster secret (a stranger, or a rank whose "
                              "MESHLM_CLUSTER_SECRET or hostfile \"secret\" differs from the leader's)")
        return None

    def welcome(self, secret: ClusterSecret, world_size: int) -> bytes:
        """WELCOME (seq 1) for this worker, with the leader's proof for its nonce."""
        assert self.hello is not None, "WELCOME before the worker proved itself"
        mac = welcome_proof(secret, self.hello.nonce, self.nonce, wire.welcome_fields(world_size))
        return wire.encode_frame(Kind.WELCOME, 1, wire.encode(Welcome(world_size, mac)))


@dataclass(frozen=True)
class Joining:
    """Worker side: what one rank says about itself, and where it is dialling (for messages)."""

    hello: Hello  # its nonce is fresh for this connection
    leader: str  # host:port


def prove_worker(link: Link, send: Callable[[Kind, bytes], None], secret: ClusterSecret, joining: Joining,
                 deadline: float) -> Welcome:
    """HELLO, CHALLENGE, PROOF, then WELCOME, whose proof must match before any plan is accepted.
    `send` writes one frame with the worker's next sequence number."""
    hello = wire.encode(joining.hello)
    send(Kind.HELLO, hello)  # before reading, so a leader of another build sees our version at once
    leader_nonce = wire.decode(Kind.CHALLENGE, _handshake_frame(link, Kind.CHALLENGE, joining, deadline).payload).nonce
    send(Kind.PROOF, wire.encode(Proof(hello_proof(secret, leader_nonce, hello))))
    welcome = wire.decode(Kind.WELCOME, _handshake_frame(link, Kind.WELCOME, joining, deadline).payload)
    fields = wire.welcome_fields(welcome.world_size)
    if not proof_matches(welcome_proof(secret, joining.hello.nonce, leader_nonce, fields), welcome.mac):
        raise HandshakeError(
            f"rank {joining.hello.rank}: the process at {joining.leader} did not prove it holds the cluster "
            "secret, so its commands are refused (a stranger on the control port, or a leader with another secret)")
    return welcome


def _handshake_frame(link: Link, kind: Kind, joining: Joining, deadline: float) -> Frame:
    rank = joining.hello.rank
    try:
        frame = link.recv(deadline)
    except LinkTimeout:
        raise HandshakeError(f"rank {rank}: no {kind.name} from the leader before the deadline") from None
    except LinkClosed as e:
        raise HandshakeError(f"rank {rank}: leader hung up during the handshake ({e})") from None
    except VersionMismatch as e:
        raise HandshakeError(_refuse_version(link, joining, e.version)) from None
    if frame.kind is Kind.REJECT:
        if frame.version == wire.VERSION and wire.decode_reason(frame.payload) == BUSY:
            raise LeaderBusy(_rejected(frame, joining))
        raise HandshakeError(_rejected(frame, joining))
    if frame.kind is not kind:
        raise ProtocolError(f"expected {kind.name} or REJECT, got {frame.kind.name}")
    return frame


def _refuse_version(link: Link, joining: Joining, version: int) -> str:
    """Tell a leader of another build why, in its own version (REJECT's layout is frozen); return the reason."""
    reason = (f"rank {joining.hello.rank}: the leader at {joining.leader} speaks control protocol version "
              f"{version}, this build speaks {wire.VERSION}: all ranks must run the same meshlm version")
    try:
        link.send(wire.encode_reject(1, reason, version), timeout=1.0)  # 1: only HELLO went before
    except (LinkClosed, ProtocolError):
        pass
    return reason


def _rejected(frame: Frame, joining: Joining) -> str:
    # Unproven (before WELCOME): cut, and its control characters escaped, so that a squatter on the control
    # port cannot write megabytes, or forged lines, into this rank's log (helper-61: 8 MB and a fake INFO line)
    reason = "".join(c if c.isprintable() else repr(c)[1:-1] for c in wire.decode_reason(frame.payload)[:400])
    if frame.version != wire.VERSION:
        return (f"the leader at {joining.leader} (control protocol version {frame.version}, this build speaks "
                f"{wire.VERSION}) rejected rank {joining.hello.rank}: {reason}")
    return f"leader rejected rank {joining.hello.rank}: {reason}"
