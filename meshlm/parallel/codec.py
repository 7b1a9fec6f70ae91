"""Control-plane wire format: framed, versioned, checksummed binary messages.

No pickle, no eval: every field is written explicitly with `struct`, so a bad
or hostile peer produces a `ProtocolError`, never code execution. All integers
are little-endian.

Frame = 28-byte header + payload:

| offset | size | field    | notes                                           |
| ------ | ---- | -------- | ----------------------------------------------- |
| 0      | 4    | magic    | b"MLCP"                                         |
| 4      | 2    | version  | u16, `VERSION`; any other value is refused      |
| 6      | 1    | kind     | u8, `Kind`                                      |
| 7      | 1    | flags    | u8, reserved, must be 0                         |
| 8      | 8    | seq      | u64, per direction of one connection, +1 a frame|
| 16     | 4    | length   | u32, payload bytes, <= max_payload (64 MiB)     |
| 20     | 8    | checksum | u64, blake2b-8 of header bytes 0..20 + payload  |

Payloads (`str` = u32 byte length + UTF-8, `i32[]`/`i64[]` = u32 count + packed
int32/int64, `int` = u16 byte count + signed two's-complement bytes (any size),
`opt` = u8 present flag (0/1) + value, `bool` = u8 0/1):

| kind      | dir | payload                                                       |
| --------- | --- | ------------------------------------------------------------- |
| HELLO     | w→l | rank u32, world_size u32, model fingerprint str               |
| WELCOME   | l→w | world_size u32, model fingerprint str                         |
| REJECT    | l→w | reason str (then the leader closes the connection)            |
| PLAN      | l→w | StepPlan, see `encode_plan`                                   |
| HEARTBEAT | l→w | empty                                                         |
| SHUTDOWN  | l→w | reason str                                                    |
| ACK       | w→l | step_id u64, batch fingerprint u64, error str ("" = ok)       |

PLAN payload, in order:

| field                | encoding                                                   |
| -------------------- | ---------------------------------------------------------- |
| step_id, fingerprint | u64, u64                                                   |
| new sequences        | u32 count, each: uid i64, cached_len u64, prefix_ids i32[], |
|                      | max_tokens int, temperature f64, top_p f64, top_k int,     |
|                      | min_p f64, seed opt int, presence_penalty f64,             |
|                      | frequency_penalty f64, logprobs opt int, stop: u32 count + |
|                      | str each, stop_token_ids i32[], ignore_eos bool            |
| chunks               | u32 count, each: uid i64, start u64, sample bool,          |
|                      | token_ids i32[]                                            |
| removed              | i64[]                                                      |
"""

from __future__ import annotations

import array
import enum
import hashlib
import struct
import sys
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from meshlm.engine.plan import Chunk, NewSequence, StepPlan
from meshlm.engine.request import SamplingParams

MAGIC = b"MLCP"
VERSION = 1
DEFAULT_MAX_PAYLOAD = 64 << 20

_HEADER = struct.Struct("<4sHBBQIQ")
HEADER_SIZE = _HEADER.size  # 28
_CHECKED = HEADER_SIZE - 8  # header bytes covered by the checksum (all but the checksum itself)
_U32_MAX = 2**32 - 1
# Token arrays are packed with `array` ("i" = C int, "q" = long long); the wire needs exactly 4 and 8 bytes.
assert array.array("i").itemsize == 4 and array.array("q").itemsize == 8

T = TypeVar("T")


class ControlError(Exception):
    """Base of every control-plane failure: catch this one to stop the cluster."""


class ProtocolError(ControlError):
    """Bytes that are not a valid control message (or a message that cannot be encoded)."""


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    PLAN = 4
    HEARTBEAT = 5
    SHUTDOWN = 6
    ACK = 7


LEADER_KINDS = frozenset({Kind.WELCOME, Kind.REJECT, Kind.PLAN, Kind.HEARTBEAT, Kind.SHUTDOWN})
WORKER_KINDS = frozenset({Kind.HELLO, Kind.ACK})


@dataclass(frozen=True)
class Header:
    kind: Kind
    seq: int
    length: int
    checksum: int


@dataclass(frozen=True)
class Frame:
    kind: Kind
    seq: int
    payload: bytes = field(repr=False)


# -- frames -----------------------------------------------------------------


def _checksum(prefix: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = hashlib.blake2b(prefix, digest_size=8)
    h.update(payload)
    return int.from_bytes(h.digest(), "little")


def encode_frame(kind: Kind, seq: int, payload: bytes = b"", *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind!r}") from None
    if len(payload) > min(max_payload, _U32_MAX):
        raise ProtocolError(f"{kind.name} payload of {len(payload)} bytes exceeds the limit of {max_payload} bytes")
    if not 0 <= seq < 2**64:
        raise ProtocolError(f"sequence number {seq} does not fit u64")
    prefix = _HEADER.pack(MAGIC, VERSION, kind, 0, seq, len(payload), 0)[:_CHECKED]
    return prefix + struct.pack("<Q", _checksum(prefix, payload)) + payload


def decode_header(data: bytes | bytearray | memoryview, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Header:
    """Validate the fixed header before any payload is read, so an oversized frame is refused unread."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(data)} bytes, need {HEADER_SIZE}")
    magic, version, kind, flags, seq, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a meshlm control stream")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version}, this build speaks {VERSION}: all ranks must run the same meshlm version"
        )
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if flags:
        raise ProtocolError(f"unsupported frame flags {flags:#04x} in {kind.name} frame")
    if length > max_payload:
        raise ProtocolError(f"{kind.name} frame announces {length} payload bytes, limit is {max_payload}")
    return Header(kind, seq, length, checksum)


def _verified(header: Header, data: bytes | bytearray | memoryview) -> Frame:
    """`data` holds exactly one frame whose header has already been validated."""
    view = memoryview(data)
    payload = view[HEADER_SIZE:]
    if _checksum(view[:_CHECKED], payload) != header.checksum:
        raise ProtocolError(f"checksum mismatch in {header.kind.name} frame seq {header.seq}: corrupted in transit")
    return Frame(header.kind, header.seq, bytes(payload))


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


# -- payload primitives -------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def pack(self, fmt: str, *values: object) -> None:
        try:
            self.buf += struct.pack(fmt, *values)
        except (struct.error, TypeError) as e:
            raise ProtocolError(f"cannot encode {', '.join(map(_short, values))} as {fmt!r}: {e}") from None

    def u8(self, v: int) -> None:
        self.pack("<B", v)

    def u32(self, v: int) -> None:
        self.pack("<I", v)

    def u64(self, v: int) -> None:
        self.pack("<Q", v)

    def i64(self, v: int) -> None:
        self.pack("<q", v)

    def f64(self, v: float) -> None:
        self.pack("<d", v)

    def flag(self, v: bool) -> None:
        self.u8(1 if v else 0)

    def big(self, v: int) -> None:
        # Client-chosen integers (seed, top_k) are unbounded in the API; a huge one must not crash the broadcast.
        n = (v.bit_length() + 8) // 8  # room for the sign bit
        if n > 0xFFFF:
            raise ProtocolError(f"cannot encode a {v.bit_length()}-bit integer (limit {0xFFFF * 8 - 1} bits)")
        self.pack("<H", n)
        self.buf += v.to_bytes(n, "little", signed=True)

    def opt_big(self, v: int | None) -> None:
        self.flag(v is not None)
        if v is not None:
            self.big(v)

    def text(self, s: str) -> None:
        # surrogatepass: JSON can carry lone surrogates; they must round-trip, not crash the leader.
        raw = s.encode("utf-8", "surrogatepass")
        self.u32(len(raw))
        self.buf += raw

    def int32s(self, values: tuple[int, ...]) -> None:
        self.u32(len(values))
        self.buf += _pack_array("i", values)

    def int64s(self, values: tuple[int, ...]) -> None:
        self.u32(len(values))
        self.buf += _pack_array("q", values)


def _short(v: object) -> str:
    # repr() of a gigantic int is slow or refused (int max str digits): name its size instead.
    return f"<{v.bit_length()}-bit int>" if isinstance(v, int) and v.bit_length() > 256 else repr(v)


def _pack_array(code: str, values: tuple[int, ...]) -> bytes:
    try:
        arr = array.array(code, values)
    except (OverflowError, TypeError) as e:
        raise ProtocolError(f"cannot encode integer array as {code!r}: {e}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


class _Reader:
    """Bounds-checked reads: running off the end is a ProtocolError, never an IndexError."""

    def __init__(self, data: bytes | bytearray | memoryview, what: str) -> None:
        self.view = memoryview(data).cast("B")
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n > len(self.view) - self.pos:
            raise ProtocolError(
                f"truncated {self.what} payload: need {n} bytes at offset {self.pos}, have {len(self.view) - self.pos}"
            )
        out = self.view[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int | float:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def u8(self) -> int:
        return int(self.unpack("<B"))

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def i64(self) -> int:
        return int(self.unpack("<q"))

    def f64(self) -> float:
        return float(self.unpack("<d"))

    def flag(self) -> bool:
        v = self.u8()
        if v > 1:
            raise ProtocolError(f"bad boolean byte {v} at offset {self.pos - 1} of {self.what} payload")
        return v == 1

    def big(self) -> int:
        return int.from_bytes(self.take(int(self.unpack("<H"))), "little", signed=True)

    def opt_big(self) -> int | None:
        return self.big() if self.flag() else None

    def text(self) -> str:
        raw = self.take(self.u32())
        try:
            return str(raw, "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"invalid UTF-8 in {self.what} payload: {e}") from None

    def int32s(self) -> tuple[int, ...]:
        return self._array("i", 4)

    def int64s(self) -> tuple[int, ...]:
        return self._array("q", 8)

    def _array(self, code: str, size: int) -> tuple[int, ...]:
        count = self.u32()
        arr = array.array(code)
        arr.frombytes(self.take(count * size))
        if sys.byteorder == "big":
            arr.byteswap()
        return tuple(arr)

    def items(self, read: Callable[[], T]) -> tuple[T, ...]:
        """A u32 count followed by that many items (the count is bounded by truncation, not pre-allocated)."""
        return tuple(read() for _ in range(self.u32()))

    def done(self) -> None:
        extra = len(self.view) - self.pos
        if extra:
            raise ProtocolError(f"{extra} bytes of trailing garbage in {self.what} payload")


def _decode(data: bytes | bytearray | memoryview, what: str, read: Callable[[_Reader], T]) -> T:
    r = _Reader(data, what)
    value = read(r)
    r.done()
    return value


# -- PLAN -------------------------------------------------------------------------


def _write_params(w: _Writer, p: SamplingParams) -> None:
    w.big(p.max_tokens)
    w.f64(p.temperature)
    w.f64(p.top_p)
    w.big(p.top_k)
    w.f64(p.min_p)
    w.opt_big(p.seed)
    w.f64(p.presence_penalty)
    w.f64(p.frequency_penalty)
    w.opt_big(p.logprobs)
    w.u32(len(p.stop))
    for s in p.stop:
        w.text(s)
    w.int32s(p.stop_token_ids)
    w.flag(p.ignore_eos)


def _read_params(r: _Reader) -> SamplingParams:
    kwargs = dict(
        max_tokens=r.big(),
        temperature=r.f64(),
        top_p=r.f64(),
        top_k=r.big(),
        min_p=r.f64(),
        seed=r.opt_big(),
        presence_penalty=r.f64(),
        frequency_penalty=r.f64(),
        logprobs=r.opt_big(),
        stop=r.items(r.text),
        stop_token_ids=r.int32s(),
        ignore_eos=r.flag(),
    )
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise ProtocolError(f"invalid sampling parameters in PLAN: {e}") from None


def _write_new(w: _Writer, n: NewSequence) -> None:
    w.i64(n.uid)
    w.u64(n.cached_len)
    w.int32s(n.prefix_ids)
    _write_params(w, n.params)


def _read_new(r: _Reader) -> NewSequence:
    uid, cached_len, prefix_ids = r.i64(), r.u64(), r.int32s()
    return NewSequence(uid=uid, cached_len=cached_len, params=_read_params(r), prefix_ids=prefix_ids)


def _write_chunk(w: _Writer, c: Chunk) -> None:
    w.i64(c.uid)
    w.u64(c.start)
    w.flag(c.sample)
    w.int32s(c.token_ids)


def _read_chunk(r: _Reader) -> Chunk:
    uid, start, sample = r.i64(), r.u64(), r.flag()
    return Chunk(uid=uid, start=start, token_ids=r.int32s(), sample=sample)


def encode_plan(plan: StepPlan) -> bytes:
    """The PLAN payload; layout in the module docstring."""
    w = _Writer()
    w.u64(plan.step_id)
    w.u64(plan.fingerprint)
    w.u32(len(plan.new))
    for n in plan.new:
        _write_new(w, n)
    w.u32(len(plan.chunks))
    for c in plan.chunks:
        _write_chunk(w, c)
    w.int64s(plan.removed)
    return bytes(w.buf)


def _read_plan(r: _Reader) -> StepPlan:
    step_id, fingerprint = r.u64(), r.u64()
    new = r.items(lambda: _read_new(r))
    chunks = r.items(lambda: _read_chunk(r))
    return StepPlan(step_id=step_id, new=new, chunks=chunks, removed=r.int64s(), fingerprint=fingerprint)


def decode_plan(data: bytes | bytearray | memoryview) -> StepPlan:
    return _decode(data, "PLAN", _read_plan)


# -- HELLO / WELCOME / ACK / reasons ------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A worker introduces itself; the leader checks every rank loaded the same model revision."""

    rank: int
    world_size: int
    fingerprint: str


@dataclass(frozen=True)
class Welcome:
    """The leader admits a worker once every rank has said HELLO."""

    world_size: int
    fingerprint: str


@dataclass(frozen=True)
class Ack:
    """A worker applied plan `step_id`; `fingerprint` is its own batch digest, `error` why it failed ("" = ok)."""

    step_id: int
    fingerprint: int
    error: str = ""


def encode_hello(h: Hello) -> bytes:
    w = _Writer()
    w.u32(h.rank)
    w.u32(h.world_size)
    w.text(h.fingerprint)
    return bytes(w.buf)


def decode_hello(data: bytes | bytearray | memoryview) -> Hello:
    return _decode(data, "HELLO", lambda r: Hello(rank=r.u32(), world_size=r.u32(), fingerprint=r.text()))


def encode_welcome(m: Welcome) -> bytes:
    w = _Writer()
    w.u32(m.world_size)
    w.text(m.fingerprint)
    return bytes(w.buf)


def decode_welcome(data: bytes | bytearray | memoryview) -> Welcome:
    return _decode(data, "WELCOME", lambda r: Welcome(world_size=r.u32(), fingerprint=r.text()))


def encode_ack(a: Ack) -> bytes:
    w = _Writer()
    w.u64(a.step_id)
    w.u64(a.fingerprint)
    w.text(a.error)
    return bytes(w.buf)


def decode_ack(data: bytes | bytearray | memoryview) -> Ack:
    return _decode(data, "ACK", lambda r: Ack(step_id=r.u64(), fingerprint=r.u64(), error=r.text()))


def encode_reason(reason: str) -> bytes:
    """Payload of REJECT and SHUTDOWN."""
    w = _Writer()
    w.text(reason)
    return bytes(w.buf)


def decode_reason(data: bytes | bytearray | memoryview) -> str:
    return _decode(data, "reason", lambda r: r.text())


def decode_empty(data: bytes | bytearray | memoryview, what: str) -> None:
    """HEARTBEAT carries nothing; bytes there mean the peer speaks something else."""
    _decode(data, what, lambda r: None)
