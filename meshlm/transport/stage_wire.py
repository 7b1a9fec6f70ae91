"""Pipeline-stage wire format: the activation and KV packets one stage sends the next (no pickle).

The layout is the seed pipeline runtime's (libtorch-based), kept byte for byte so
the two can exchange packets; docs/DISTRIBUTED.md, "The stage wire format", is the spec:

    packet  = header, then `slots` tensors (2: hidden + attn_mask, or k + v)
    header  = int32 version, int32 stage_from, int32 stage_to, uint64 step, uint64 pos   ("!iiiQQ", 28 bytes)
    tensor  = uint8 defined (0/1); if 1: int32 dtype, int32 ndim, uint64 sizes[ndim], uint64 nbytes, payload

Header integers are big-endian; payloads are C-contiguous element bytes, little-endian
(every host MLX runs on is). dtype codes are PyTorch's c10::ScalarType numbers.

Decoding trusts nothing: each field is checked before the next is used, and in
`read_packet` a tensor's size is checked against the receiver's cap before its
payload is read, so a hostile or confused peer cannot make us allocate.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import mlx.core as mx
import numpy as np

if sys.byteorder != "little":  # payloads are the host's element bytes, declared little-endian on the wire
    raise ImportError("meshlm's stage wire format needs a little-endian host")

VERSION = 1
HEADER = struct.Struct("!iiiQQ")
DEFAULT_MAX_BYTES = 1 << 30  # cap for one packet's tensor bytes
MAX_NDIM = 8
KV_NDIM = 5  # [L, B, kv_heads, S, head_dim]

_DEFINED = struct.Struct("!B")
_META = struct.Struct("!ii")  # dtype, ndim
_U64 = struct.Struct("!Q")
_INT32_MAX = 2**31 - 1
_U64_MAX = 2**64 - 1
_MAX_SIZE = _INT32_MAX  # MLX shapes are int32 per axis
_MAX_EXTENT = 1 << 48  # bytes the shape spans counting empty axes as 1: keeps numpy/MLX strides far from overflow


class StageWireError(ValueError):
    """A packet that is not what the receiver expects; the message names the sending stage when known.

    Also raised for arrays or header fields that cannot be encoded."""


@dataclass(frozen=True)
class _WireDtype:
    code: int  # c10::ScalarType
    name: str
    mx: mx.Dtype
    np: np.dtype  # how the payload bytes are read; uint16 for bfloat16, which numpy lacks

    @property
    def itemsize(self) -> int:
        return self.np.itemsize


def _dtype_table() -> tuple[_WireDtype, ...]:
    rows = [(0, "uint8", mx.uint8, np.uint8), (1, "int8", mx.int8, np.int8), (2, "int16", mx.int16, np.int16),
            (3, "int32", mx.int32, np.int32), (4, "int64", mx.int64, np.int64),
            (5, "float16", mx.float16, np.float16), (6, "float32", mx.float32, np.float32),
            (7, "float64", mx.float64, np.float64), (9, "complex64", mx.complex64, np.complex64),
            (11, "bool", mx.bool_, np.bool_), (15, "bfloat16", mx.bfloat16, np.uint16),
            (27, "uint16", mx.uint16, np.uint16), (28, "uint32", mx.uint32, np.uint32),
            (29, "uint64", mx.uint64, np.uint64)]
    return tuple(_WireDtype(code, name, mxd, np.dtype(npd)) for code, name, mxd, npd in rows)


_TABLE = _dtype_table()
DTYPE_CODES: Mapping[mx.Dtype, int] = MappingProxyType({d.mx: d.code for d in _TABLE})
_BY_CODE: Mapping[int, _WireDtype] = MappingProxyType({d.code: d for d in _TABLE})
_BY_MX: Mapping[mx.Dtype, _WireDtype] = MappingProxyType({d.mx: d for d in _TABLE})


def _dtype_name(dtype: mx.Dtype) -> str:
    return _BY_MX[dtype].name if dtype in _BY_MX else str(dtype)


# -- what the receiver expects --------------------------------------------------------------------


@dataclass(frozen=True)
class PacketHeader:
    version: int
    stage_from: int
    stage_to: int
    step: int
    pos: int

    def __post_init__(self) -> None:
        _check_range("version", self.version, -(2**31), _INT32_MAX)
        _check_range("stage_from", self.stage_from, 0, _INT32_MAX)  # the wire has int32, stages are >= 0
        _check_range("stage_to", self.stage_to, 0, _INT32_MAX)
        _check_range("step", self.step, 0, _U64_MAX)
        _check_range("pos", self.pos, 0, _U64_MAX)


def _check_range(field: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StageWireError(f"{field} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise StageWireError(f"{field} {value} is outside {lo}..{hi}")


@dataclass(frozen=True)
class TensorExpect:
    dtype: mx.Dtype | None = None  # None: any supported dtype
    shape: tuple[int | None, ...] | None = None  # None: any shape; None entries: any size on that axis
    required: bool = True  # False: may be undefined

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _BY_MX:
            raise ValueError(f"{self.dtype} has no stage wire dtype code")
        if self.shape is not None and (len(self.shape) > MAX_NDIM
                                       or any(s is not None and not 0 <= s <= _MAX_SIZE for s in self.shape)):
            raise ValueError(f"no packet can carry shape {self.shape}")


@dataclass(frozen=True)
class Expect:
    """What the receiver expects of the next packet; None fields are not checked."""

    stage_from: int | None = None
    stage_to: int | None = None
    step: int | None = None
    pos: int | None = None
    tensors: tuple[TensorExpect, ...] | None = None  # one per tensor slot, in order
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")


# -- encoding -------------------------------------------------------------------------------------------


def encode_tensor(a: mx.array | None) -> bytes:
    """One tensor slot: b"\\x00" for None, else metadata and the C-contiguous element bytes (evaluates `a`)."""
    if a is None:
        return _DEFINED.pack(0)
    if not isinstance(a, mx.array):
        raise TypeError(f"expected an mlx array or None, got {type(a).__name__}")
    wire = _BY_MX.get(a.dtype)
    if wire is None:
        raise StageWireError(f"{a.dtype} has no stage wire dtype code")
    if a.ndim > MAX_NDIM:
        raise StageWireError(f"a {a.ndim}-D array cannot be sent: the stage wire carries at most {MAX_NDIM} axes")
    # numpy has no bfloat16: its bits travel as uint16, which is the same bytes.
    host = np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False))
    meta = _DEFINED.pack(1) + _META.pack(wire.code, a.ndim) + struct.pack(f"!{a.ndim}Q", *a.shape)
    return b"".join((meta, _U64.pack(host.nbytes), host))


def encode_packet(header: PacketHeader, tensors: Sequence[mx.array | None]) -> bytes:
    """The whole packet; `header.version` is written as given (VERSION unless testing a mismatch)."""
    head = HEADER.pack(header.version, header.stage_from, header.stage_to, header.step, header.pos)
    return b"".join([head, *(encode_tensor(t) for t in tensors)])


def encode_activation(stage_from: int, stage_to: int, step: int, pos: int,
                      hidden: mx.array, mask: mx.array | None = None) -> bytes:
    """Activation packet: `hidden`, then `attn_mask` (an undefined tensor when `mask` is None)."""
    if not isinstance(hidden, mx.array):
        raise TypeError(f"hidden must be an mlx array, got {type(hidden).__name__}")
    return encode_packet(PacketHeader(VERSION, stage_from, stage_to, step, pos), (hidden, mask))


def encode_kv(stage_from: int, stage_to: int, step: int, pos: int,
              k: mx.array | None = None, v: mx.array | None = None) -> bytes:
    """KV packet: `k`, then `v`, each [L, B, kv_heads, S, head_dim] when given."""
    for name, t in (("k", k), ("v", v)):
        if t is not None and t.ndim != KV_NDIM:
            raise StageWireError(f"{name} must be {KV_NDIM}-D [L, B, kv_heads, S, head_dim], got shape {t.shape}")
    return encode_packet(PacketHeader(VERSION, stage_from, stage_to, step, pos), (k, v))


# -- decoding ---------------------------------------------------------------------------------------


Recv = Callable[[int], "bytes | bytearray | memoryview"]


def decode_packet(data: bytes | bytearray | memoryview, expect: Expect,
                  slots: int = 2) -> tuple[PacketHeader, list[mx.array | None]]:
    """Decode one whole packet held in memory; missing or trailing bytes are errors.

    The arrays are copies: `data` may be reused as soon as this returns."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise StageWireError(f"truncated stage packet header: {len(view)} bytes, need {HEADER.size}")
    header = _parse_header(view[:HEADER.size], expect)
    cursor = _Cursor(view, HEADER.size)
    try:
        tensors = _read_tensors(cursor.take, header, expect, slots)
    except _Truncated as e:
        raise StageWireError(f"{_origin(header)} is truncated: {e}") from None
    if cursor.left:
        raise StageWireError(f"{_origin(header)} has {cursor.left} trailing bytes after its {slots} tensors")
    return header, tensors


def read_packet(recv_exactly: Recv, expect: Expect, slots: int = 2,
                host: bool = False) -> tuple[PacketHeader, list[mx.array | None]]:
    """Read one packet from a stream; `recv_exactly(n)` returns exactly n bytes or raises.

    `host`: return numpy arrays instead (bfloat16 payloads as uint16), touching no MLX, for a thread
    other than the one running the model (an MLX op belongs to the stream of the thread that made it).

    The header is validated before any tensor byte is read, and each tensor's metadata
    (dtype, shape, size, the running total against `expect.max_bytes`) before its payload.
    Whatever `recv_exactly` raises (EOFError, ConnectionError, TimeoutError) propagates unchanged;
    after any error the stream is at an unknown position and should be closed."""
    recv = _exact(recv_exactly)
    header = _parse_header(recv(HEADER.size), expect)
    return header, _read_tensors(recv, header, expect, slots, host)


class _Truncated(Exception):
    """decode_packet ran out of bytes (read_packet's callers see their own EOF instead)."""


class _Cursor:
    """Hands out consecutive slices of an in-memory packet."""

    def __init__(self, view: memoryview, offset: int) -> None:
        self.view = view
        self.offset = offset

    @property
    def left(self) -> int:
        return len(self.view) - self.offset

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise _Truncated(f"needed {n} bytes at offset {self.offset}, only {self.left} left")
        self.offset += n
        return self.view[self.offset - n:self.offset]


def _exact(recv_exactly: Recv) -> Recv:
    """Hold `recv_exactly` to its contract, so a short read is an error and not a struct.error."""
    def recv(n: int) -> bytes | bytearray | memoryview:
        got = recv_exactly(n)
        if len(got) != n:
            raise StageWireError(f"recv_exactly({n}) returned {len(got)} bytes")
        return got
    return recv


def _origin(header: PacketHeader) -> str:
    return f"packet from stage {header.stage_from} to stage {header.stage_to}"


def _parse_header(raw: bytes | bytearray | memoryview, expect: Expect) -> PacketHeader:
    version, stage_from, stage_to, step, pos = HEADER.unpack(raw)
    who = f"packet from stage {stage_from}" if stage_from >= 0 else f"packet with stage_from {stage_from}"
    if version != VERSION:
        raise StageWireError(f"{who} speaks stage wire version {version}, this build speaks {VERSION}: "
                             "all stages must run the same meshlm version")
    try:
        header = PacketHeader(version, stage_from, stage_to, step, pos)
    except StageWireError as e:
        raise StageWireError(f"{who}: {e}") from None
    for field in ("stage_from", "stage_to", "step", "pos"):
        want, got = getattr(expect, field), getattr(header, field)
        if want is not None and want != got:
            raise StageWireError(f"{_origin(header)}: expected {field} {want}, got {got}")
    return header


def _read_tensors(recv: Recv, header: PacketHeader, expect: Expect, slots: int,
                  host: bool = False) -> list[mx.array | None]:
    if slots < 0 or (expect.tensors is not None and len(expect.tensors) != slots):
        raise ValueError(f"{slots} tensor slots but {len(expect.tensors or ())} TensorExpects")
    out: list[mx.array | None] = []
    budget = expect.max_bytes
    for i in range(slots):
        want = expect.tensors[i] if expect.tensors is not None else None
        where = f"{_origin(header)}, tensor {i}"
        array, nbytes = _read_tensor(recv, where, want, budget, expect.max_bytes, host)
        out.append(array)
        budget -= nbytes
    return out


def _read_tensor(recv: Recv, where: str, want: TensorExpect | None, budget: int,
                 max_bytes: int, host: bool = False) -> tuple[mx.array | None, int]:
    """One tensor slot; everything but the payload is read and checked before the payload is."""
    (defined,) = _DEFINED.unpack(recv(1))
    if defined == 0:
        if want is not None and want.required:
            raise StageWireError(f"{where}: required tensor is undefined")
        return None, 0
    if defined != 1:
        raise StageWireError(f"{where}: defined flag is {defined}, must be 0 or 1")
    code, ndim = _META.unpack(recv(_META.size))
    wire = _BY_CODE.get(code)
    if wire is None:
        raise StageWireError(f"{where}: unknown dtype code {code}")
    if not 0 <= ndim <= MAX_NDIM:
        raise StageWireError(f"{where}: ndim {ndim} is outside 0..{MAX_NDIM}")
    sizes = struct.unpack(f"!{ndim}Q", recv(8 * ndim)) if ndim else ()  # never ask a stream for 0 bytes
    (nbytes,) = _U64.unpack(recv(_U64.size))
    _check_layout(where, wire, sizes, nbytes, budget, max_bytes)
    _check_expected(where, wire, sizes, want)
    payload = recv(nbytes) if nbytes else b""
    if host:
        return _to_host(where, wire, sizes, payload), nbytes
    return _to_array(where, wire, sizes, payload), nbytes


def _check_layout(where: str, wire: _WireDtype, sizes: tuple[int, ...], nbytes: int, budget: int,
                  max_bytes: int) -> None:
    for axis, size in enumerate(sizes):
        if size > _MAX_SIZE:
            raise StageWireError(f"{where}: axis {axis} has size {size}, over {_MAX_SIZE}")
    if math.prod(max(s, 1) for s in sizes) * wire.itemsize > _MAX_EXTENT:
        raise StageWireError(f"{where}: shape {sizes} is absurd")
    need = math.prod(sizes) * wire.itemsize
    if nbytes != need:
        raise StageWireError(f"{where}: announces {nbytes} payload bytes, but {wire.name} {sizes} needs {need}")
    if nbytes > max_bytes:
        raise StageWireError(f"{where}: {nbytes} bytes is over the limit of {max_bytes} bytes a packet")
    if nbytes > budget:
        raise StageWireError(f"{where}: the packet's tensors total {max_bytes - budget + nbytes} bytes, "
                             f"over the limit of {max_bytes}")


def _check_expected(where: str, wire: _WireDtype, sizes: tuple[int, ...], want: TensorExpect | None) -> None:
    if want is None:
        return
    if want.dtype is not None and want.dtype != wire.mx:
        raise StageWireError(f"{where}: expected dtype {_dtype_name(want.dtype)}, got {wire.name}")
    if want.shape is not None and (len(want.shape) != len(sizes)
                                   or any(w is not None and w != s for w, s in zip(want.shape, sizes))):
        shown = tuple("*" if w is None else w for w in want.shape)
        raise StageWireError(f"{where}: expected shape {shown}, got {sizes}")


def _to_host(where: str, wire: _WireDtype, sizes: tuple[int, ...], payload: bytes | memoryview) -> np.ndarray:
    host = np.frombuffer(payload, dtype=wire.np).reshape(sizes)
    if wire.mx == mx.bool_ and host.size and host.view(np.uint8).max() > 1:
        raise StageWireError(f"{where}: bool tensor holds bytes other than 0 and 1")
    return host


def _to_array(where: str, wire: _WireDtype, sizes: tuple[int, ...], payload: bytes | memoryview) -> mx.array:
    host = _to_host(where, wire, sizes, payload)
    if wire.mx == mx.bfloat16:
        return mx.array(host, dtype=mx.uint16).view(mx.bfloat16)
    return mx.array(host, dtype=wire.mx)  # a copy, and the dtype is explicit: MLX would narrow float64
