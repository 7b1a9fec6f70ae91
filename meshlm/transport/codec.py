"""Control-plane wire format: framed, versioned, checksummed messages (no pickle, no eval).

Frame = 28-byte header + payload (all integers little-endian):

| offset | size | field    | notes                                           |
| ------ | ---- | -------- | ----------------------------------------------- |
| 0      | 4    | magic    | b"MLCP"                                         |
| 4      | 2    | version  | u16, `VERSION`; any other value is refused,     |
|        |      |          | except in a REJECT (see below)                  |
| 6      | 1    | kind     | u8, `Kind`                                      |
| 7      | 1    | flags    | u8, reserved, must be 0                         |
| 8      | 8    | seq      | u64, per direction of one connection, +1 a frame|
| 16     | 4    | length   | u32, payload bytes, <= max_payload (64 MiB)     |
| 20     | 8    | checksum | u64, blake2b-8 of header bytes 0..20 + payload  |

Payloads are derived from the message dataclasses, not written by hand: each
is the msgpack encoding (msgspec) of one dataclass, decoded back into that
type with strict type checking, so a field of the wrong type, a missing field
or trailing bytes are a `ProtocolError`, never a half-built message:

| kind      | dir | payload                                                  |
| --------- | --- | -------------------------------------------------------- |
| CHALLENGE | l→w | `Challenge` (the leader's 32-byte nonce)                 |
| HELLO     | w→l | `Hello` (rank, world size, nonce)                        |
| PROOF     | w→l | `Proof` (mac, see `meshlm.transport.auth.hello_proof`)   |
| WELCOME   | l→w | `Welcome` (world size, mac)                              |
| LOADED    | w→l | `Loaded` (model fingerprint, KV blocks the rank holds)   |
| START     | l→w | empty                                                    |
| PLAN      | l→w | `meshlm.engine.plan.StepPlan`                            |
| TOKENS    | l→w | `TokenIds` (a plan's input ids, sent after it)           |
| HEARTBEAT | l→w | empty                                                    |
| ACK       | w→l | `Ack` (step id, batch fingerprint, error, times, keys, sums) |
| REJECT    | any | reason: u32 byte length + UTF-8 (a frozen layout)        |
| SHUTDOWN  | l→w | reason, as REJECT                                        |

Handshake, in two rounds around the model load:
- the roll call, before any rank joins the MLX group or loads a weight: the
  leader sends CHALLENGE as soon as it accepts a connection, and the worker
  sends HELLO as soon as it connects, so each side reads the other's version
  in its first frame. The worker then sends PROOF; the leader admits it once
  the proof checks and every rank is present, and sends WELCOME (seq 1);
- the start, once each rank has loaded its share: the worker sends LOADED
  (seq 2); once every rank has, with the leader's fingerprint, the leader
  sends START (seq 2).
PLAN, HEARTBEAT and SHUTDOWN follow from seq 3; the worker's ACKs from seq 3.
Between the rounds the connection is idle but open, so a rank that dies
while loading is noticed at once (its kernel closes the socket).

REJECT's layout (this header, kind 3, a reason) is frozen across versions: a
peer that meets a frame of another version answers with a REJECT written in
that version, and a REJECT of any version is decoded, so two builds that
disagree both fail at once and say why.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field


import msgspec

from meshlm.engine.plan import StepPlan
from meshlm.kv.keys import KEY_BYTES

MAGIC = b"MLCP"
VERSION = 12  # 2: CHALLENGE/PROOF handshake with a cluster secret; 3: msgpack payloads, block-table plans;
# 4: plans carry KV exports (disaggregated prefill); 5: ACKs carry the worker's time by phase;
# 6: a new sequence names the context-parallel rank holding it whole (--cp-min-tokens);
# 7: a plan's ids may follow it in a TOKENS frame (a pipeline's step planned ahead);
# 8: the roll call (HELLO..WELCOME) comes before the model load, LOADED and START after it;
# 9: ACKs name the blocks a plan loads that the rank could not read;
# 10: a started worker heartbeats too, so that a stopped or hung rank is found within --worker-timeout
# 11: plans carry `touches`, the SSD files of blocks hot in RAM to refresh (their LRU order and TTL)
# 12: ACKs carry the worker's shared-memory sums (count, seconds, seconds waiting), as rank 0 reports its own
DEFAULT_MAX_PAYLOAD = 64 << 20
NONCE_SIZE = 32
MAC_SIZE = 32  # HMAC-SHA256

_HEADER = struct.Struct("<4sHBBQIQ")
HEADER_SIZE = _HEADER.size  # 28
_CHECKED = HEADER_SIZE - 8  # header bytes covered by the checksum (all but the checksum itself)
_U32_MAX = 2**32 - 1




class ControlError(Exception):
    """Base of every control-plane failure: catch this one to stop the cluster."""


class ProtocolError(ControlError):
    """Bytes that are not a valid control message (or a message that cannot be encoded)."""


class VersionMismatch(ProtocolError):
    """A meshlm control frame of another protocol version: the peer runs another meshlm build."""

    def __init__(self, version: int) -> None:
        super().__init__(f"protocol version {version}, this build speaks {VERSION}: "
                         "all ranks must run the same meshlm version")
        self.version = version


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    PLAN = 4
    HEARTBEAT = 5
    SHUTDOWN = 6
    ACK = 7
    CHALLENGE = 8
    PROOF = 9
    TOKENS = 10
    LOADED = 11
    START = 12


LEADER_KINDS = frozenset({Kind.CHALLENGE, Kind.WELCOME, Kind.START, Kind.REJECT, Kind.PLAN, Kind.HEARTBEAT,
                          Kind.SHUTDOWN, Kind.TOKENS})
WORKER_KINDS = frozenset({Kind.HELLO, Kind.PROOF, Kind.LOADED, Kind.REJECT, Kind.ACK, Kind.HEARTBEAT})


@dataclass(frozen=True)
class Header:
    version: int
    kind: Kind
    seq: int
    length: int
    checksum: int


@dataclass(frozen=True)
class Frame:
    kind: Kind
    seq: int
    payload: bytes = field(repr=False)
    version: int = VERSION  # another version only in a REJECT from a peer of another build


# -- frames -----------------------------------------------------------------


def _checksum(prefix: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = hashlib.blake2b(prefix, digest_size=8)
    h.update(payload)
    return int.from_bytes(h.digest(), "little")


def encode_frame(kind: Kind, seq: int, payload: bytes = b"", *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    return _encode(kind, seq, payload, max_payload, VERSION)


def encode_reject(seq: int, reason: str, version: int = VERSION) -> bytes:
    """A whole REJECT frame; `version`: the peer's, when it runs another build (REJECT's layout is frozen)."""
    if not 0 <= version <= 0xFFFF:
        raise ProtocolError(f"protocol version {version} does not fit u16")
    return _encode(Kind.REJECT, seq, encode_reason(reason), DEFAULT_MAX_PAYLOAD, version)


def _encode(kind: Kind, seq: int, payload: bytes, max_payload: int, version: int) -> bytes:
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind!r}") from None
    if len(payload) > min(max_payload, _U32_MAX):
        raise ProtocolError(f"{kind.name} payload of {len(payload)} bytes exceeds the limit of {max_payload} bytes")
    if not 0 <= seq < 2**64:
        raise ProtocolError(f"sequence number {seq} does not fit u64")
    prefix = _HEADER.pack(MAGIC, version, kind, 0, seq, len(payload), 0)[:_CHECKED]
    return prefix + struct.pack("<Q", _checksum(prefix, payload)) + payload


def decode_header(data: bytes | bytearray | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Header:
    """Validate the fixed header before any payload is read, so an oversized frame is refused unread."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(data)} bytes, need {HEADER_SIZE}")
    magic, version, kind, flags, seq, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a meshlm control stream")
    if version != VERSION and kind != Kind.REJECT:  # a REJECT is read whatever its version: it says why
        raise VersionMismatch(version)
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if flags:
        raise ProtocolError(f"unsupported frame flags {flags:#04x} in {kind.name} frame")
    if length > max_payload:
        raise ProtocolError(f"{kind.name} frame announces {length} payload bytes, limit is {max_payload}")
    return Header(version, kind, seq, length, checksum)


def _verified(header: Header, data: bytes | bytearray | memoryview) -> Frame:
    """`data` holds exactly one frame whose header has already been validated."""
    view = memoryview(data)
    payload = view[HEADER_SIZE:]
    if _checksum(view[:_CHECKED], payload) != header.checksum:
        if header.version != VERSION:  # another build's REJECT we cannot check: the version is the news
            raise VersionMismatch(header.version)
        raise ProtocolError(f"checksum mismatch in {header.kind.name} frame seq {header.seq}: corrupted in transit")
    return Frame(header.kind, header.seq, bytes(payload), header.version)


def decode_frame(data: bytes | bytearray | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Decode exactly one frame; missing or extra bytes are errors."""
    header = decode_header(data, max_payload=max_payload)
    want = HEADER_SIZE + header.length
    if len(data) < want:
        raise ProtocolError(f"truncated {header.kind.name} frame: {len(data)} bytes, header announces {want}")
    if len(data) > want:
        raise ProtocolError(f"{len(data) - want} bytes of trailing garbage after {header.kind.name} frame")
    return _verified(header, data)


class FrameDecoder:
    """Incremental decoder for a byte stream: `feed` what arrives, pop whole frames with `next_frame`.

    Headers are validated as soon as their 28 bytes arrive, so a hostile length
    is refused before its payload is buffered.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()
        self._header: Header | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_frame(self) -> Frame | None:
        if self._header is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._header = decode_header(self._buf, max_payload=self.max_payload)
        want = HEADER_SIZE + self._header.length
        if len(self._buf) < want:
            return None
        header, self._header = self._header, None
        frame = _verified(header, self._buf[:want])
        del self._buf[:want]
        return frame


# -- messages -----------------------------------------------------------------------


def _fixed(value: bytes, size: int, what: str) -> None:
    if len(value) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(value)}")


@dataclass(frozen=True)
class Challenge:
    """The leader's fresh nonce: the worker's proof must cover it (no replay)."""

    nonce: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _fixed(self.nonce, NONCE_SIZE, "a nonce")


@dataclass(frozen=True)
class Hello:
    """A worker introduces itself, before it loads anything. The leader believes none of it until the
    worker's PROOF checks. `nonce`: the worker's challenge to the leader."""

    rank: int
    world_size: int
    nonce: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _fixed(self.nonce, NONCE_SIZE, "a nonce")


@dataclass(frozen=True)
class Proof:
    mac: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _fixed(self.mac, MAC_SIZE, "a mac")


@dataclass(frozen=True)
class Welcome:
    """The leader admits a worker once every rank has proved itself; `mac` proves the leader holds the secret."""

    world_size: int
    mac: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _fixed(self.mac, MAC_SIZE, "a mac")


@dataclass(frozen=True)
class Loaded:
    """A welcomed worker has loaded its share: every rank must have loaded the same model revision."""

    fingerprint: str
    kv_blocks: int = 0  # KV blocks this rank's budget holds (0: not said); the leader plans within the least


@dataclass(frozen=True)
class Ack:
    """A worker applied plan `step_id`; `fingerprint` is its own batch digest, `error` why it failed ("" = ok),
    `times` its seconds by phase so far (meshlm/step_times.py, in PHASES order; checked by the leader)."""

    step_id: int
    fingerprint: int
    error: str = ""
    times: tuple[float, ...] = ()
    missing: tuple[bytes, ...] = ()  # keys of blocks the plan loads that this rank could not read
    # Its shared-memory sums so far (transport/local_reduce.py): count, seconds, seconds waiting for the
    # other ranks; empty where it sums with MLX's backend
    sums: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for key in self.missing:
            _fixed(key, KEY_BYTES, "a block key")


@dataclass(frozen=True)
class TokenIds:
    """The input ids of plan `step_id` (sent with `ids_follow`), one per chunk in order."""

    step_id: int
    ids: tuple[int, ...]


MESSAGE_TYPES: dict[Kind, type] = {Kind.CHALLENGE: Challenge, Kind.HELLO: Hello, Kind.PROOF: Proof,
                                   Kind.WELCOME: Welcome, Kind.LOADED: Loaded, Kind.PLAN: StepPlan, Kind.ACK: Ack,
                                   Kind.TOKENS: TokenIds}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(t) for kind, t in MESSAGE_TYPES.items()}


def encode(message: object) -> bytes:
    """The payload of one message (a dataclass of MESSAGE_TYPES)."""
    try:
        return _ENCODER.encode(message)
    except (TypeError, OverflowError, ValueError) as e:  # e.g. an integer beyond 64 bits
        raise ProtocolError(f"cannot encode {type(message).__name__}: {e}") from None


def decode(kind: Kind, data: bytes | bytearray | memoryview):
    """The message a payload of `kind` holds, type-checked field by field."""
    try:
        return _DECODERS[kind].decode(data)
    except KeyError:
        raise ProtocolError(f"{kind.name} frames carry no message") from None
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
        raise ProtocolError(f"invalid {kind.name} payload: {e}") from None


def encode_plan(plan: StepPlan) -> bytes:
    return encode(plan)


def decode_plan(data: bytes | bytearray | memoryview) -> StepPlan:
    return decode(Kind.PLAN, data)


def welcome_fields(world_size: int) -> bytes:
    """What the leader's WELCOME proof covers (its fields but the mac)."""
    return _ENCODER.encode((world_size,))


# -- reasons (REJECT, SHUTDOWN): a layout frozen across versions ------------------------------------


def encode_reason(reason: str) -> bytes:
    # surrogatepass: JSON can carry lone surrogates; they must round-trip, not crash the leader.
    raw = reason.encode("utf-8", "surrogatepass")
    return struct.pack("<I", len(raw)) + raw


def decode_reason(data: bytes | bytearray | memoryview) -> str:
    view = memoryview(data)
    if len(view) < 4 or struct.unpack_from("<I", view)[0] != len(view) - 4:
        raise ProtocolError(f"malformed reason payload ({len(view)} bytes)")
    try:
        return str(view[4:], "utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"invalid UTF-8 in a reason: {e}") from None


def decode_empty(data: bytes | bytearray | memoryview, what: str) -> None:
    """HEARTBEAT carries nothing; bytes there mean the peer speaks something else."""
    if len(data):
        raise ProtocolError(f"{len(data)} bytes of trailing garbage in {what} payload")
