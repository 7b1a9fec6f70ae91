"""One KV block on disk: a safetensors file, read in one go and checked before use.

A block file holds `k.0 .. k.{L-1}` and `v.0 .. v.{L-1}` (per layer
(kv_heads, block_size, head_dim)) and string metadata (format, key, salt,
rank, checksum). Both directions are done here rather than with MLX's
safetensors functions (the files stay ones they read): one `read` of the
whole file and a memcpy per array takes ~1 ms for a block of the demo model
against ~6 ms for `mx.load`'s 60 lazy loads (a 2,000-token SSD hit reads 126
of them); `write_block` costs what `mx.save_safetensors` does (~0.4 ms for a
256 KiB block, the page cache's work), and the SSD tier's `DirectWriter`
writes the same files around the page cache. The checksum, taken from the
same buffers the file is written from, is a CRC-32
(as the disaggregated KV packets'): it guards against torn and corrupted
files, not tampering, and blake2b cost 0.36 ms a 256 KiB block on the SSD
writer's thread, which under tensor parallelism delays whichever rank it runs
on while the others wait for it in the next all-reduce. The reader trusts
nothing in the file: the header must be well-formed JSON naming exactly the
tensors of a block of the reading store's shape (layers, per-layer shape, dtype),
each within the file, with sizes that match their shapes, and the checksum
over the tensor bytes must match the one in the metadata.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from meshlm.kv.store import Array, BlockData, KVShape

MAX_HEADER_BYTES = 16 * 2**20
# safetensors dtype -> (numpy dtype of the raw bytes, MLX dtype they are viewed as)
_DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
}
_NAMES = {mx_dtype: name for name, (_, mx_dtype) in _DTYPES.items()}  # what the writer records
# The writer also takes numpy host copies (KVStore.extract(host=True)); numpy's uint16 is not bfloat16.
_NAMES.update({np.dtype(np_dtype): name for name, (np_dtype, _) in _DTYPES.items() if name != "BF16"})


def _digest(named_bytes: Iterable[tuple[str, memoryview]]) -> str:
    crc = 0
    for name, raw in named_bytes:
        crc = zlib.crc32(raw, zlib.crc32(name.encode(), crc))
    return f"crc32:{crc:08x}"


def _raw_bytes(arrays: dict[str, Array]) -> dict[str, memoryview]:
    """Each array's bytes, row-major, in name order. A block's float32 or float16 arrays (MLX or numpy)
    are contiguous and exported as they are; other MLX arrays (bfloat16 has no buffer format, a strided
    view) go through MLX ops first, which cost ~6 us an array."""
    names = sorted(arrays)
    direct = {}
    for name in names:
        a = arrays[name]
        view = memoryview(a) if a.dtype != mx.bfloat16 else None
        if view is not None and view.c_contiguous:
            direct[name] = view.cast("B")
    pending = {name: mx.contiguous(arrays[name]).view(mx.uint8) for name in names if name not in direct}
    mx.eval(list(pending.values()))
    return {name: direct[name] if name in direct else memoryview(pending[name]).cast("B") for name in names}


def checksum(arrays: dict[str, Array]) -> str:
    """Digest of every tensor's name and bytes, in name order (stored in the file's metadata)."""
    return _digest(_raw_bytes(arrays).items())


ALIGN = 4096  # O_DIRECT wants the buffer, the file offset and the length aligned to the device's blocks


def _encode(arrays: dict[str, Array], metadata: dict[str, str], align: int) -> tuple[bytes, dict[str, memoryview]]:
    """The file's first bytes (length, JSON header padded so the tensor data starts `align`-aligned, as
    safetensors allows) and each tensor's bytes in file order."""
    if bad := {str(a.dtype) for a in arrays.values() if a.dtype not in _NAMES}:
        raise ValueError(f"block files hold float32, float16 or bfloat16 tensors, not {sorted(bad)}")
    raw = _raw_bytes(arrays)
    header: dict[str, object] = {"__metadata__": {**metadata, "checksum": _digest(raw.items())}}
    offset = 0
    for name, data in raw.items():
        a = arrays[name]
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % align)
    return struct.pack("<Q", len(encoded)) + encoded, raw


# Header bytes a block file's JSON can take, generously: its metadata (format, key, salt, rank, checksum)
# and one entry a tensor (name, dtype, shape, offsets).
_METADATA_BYTES, _ENTRY_BYTES = 1024, 160


def block_file_bytes(shape: KVShape) -> int:
    """At most the size of a block file of a store of `shape` (DirectWriter's, header padded to ALIGN):
    what an SSD tier must hold to keep one block."""
    header = 8 + _METADATA_BYTES + 2 * shape.num_layers * _ENTRY_BYTES
    return -(-header // ALIGN) * ALIGN + shape.block_bytes


def write_block(path: Path, arrays: dict[str, Array], metadata: dict[str, str]) -> None:
    """Write `arrays` as a safetensors file (tensors in name order), `metadata` plus their checksum in its
    header, through the page cache; the tensor data starts 8-byte aligned, as safetensors writers do.
    Raises ValueError for a dtype block files do not hold, OSError from writing."""
    _write_buffered(path, *_encode(arrays, metadata, 8))


# A block holds a prompt's KV, from which its text can be read back: the serving user's alone, and never
# written through a link planted in its name.
FILE_MODE = 0o600
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_buffered(path: Path, head: bytes, raw: dict[str, memoryview]) -> None:
    with os.fdopen(os.open(path, _WRITE_FLAGS, FILE_MODE), "wb") as f:
        f.write(head)
        for data in raw.values():
            f.write(data)


class DirectWriter:
    """Writes block files around the page cache (O_DIRECT), from one reused aligned buffer: one writer
    thread's. Write-through of every committed block otherwise fills the page cache with fresh pages,
    and on this VM that cost each tensor-parallel rank ~4.5 ms of a ~70 ms step (scaling.py, TP=2:
    rank device time 67.9-69.2 -> 63.0-64.8 ms; docs/BENCHMARKS.md), where one core's server, with an
    idle core beside it, showed nothing. The files are the same safetensors `write_block` writes, their
    data 4 KiB-aligned. Where O_DIRECT is missing (macOS) or refused (a file system without it), it
    writes through the page cache from then on."""

    def __init__(self) -> None:
        self.direct = hasattr(os, "O_DIRECT")
        self._buffer: mmap.mmap | None = None  # page-aligned, as O_DIRECT needs

    def write(self, path: Path, arrays: dict[str, Array], metadata: dict[str, str]) -> None:
        """As `write_block`. Raises ValueError for a dtype block files do not hold, OSError from writing."""
        head, raw = _encode(arrays, metadata, ALIGN)
        if self.direct:
            try:
                self._write_direct(path, head, raw)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # this file system has no O_DIRECT (tmpfs before Linux 6.6, some FUSE ones)
        _write_buffered(path, head, raw)

    def _write_direct(self, path: Path, head: bytes, raw: dict[str, memoryview]) -> None:
        size = len(head) + sum(len(d) for d in raw.values())
        padded = -(-size // ALIGN) * ALIGN
        if self._buffer is None or len(self._buffer) < padded:
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = mmap.mmap(-1, padded)
        with memoryview(self._buffer) as buffer:
            pos = len(head)
            buffer[:pos] = head
            for data in raw.values():
                buffer[pos : pos + len(data)] = data
                pos += len(data)
            fd = os.open(path, _WRITE_FLAGS | os.O_DIRECT, FILE_MODE)
            try:
                if os.write(fd, buffer[:padded]) != padded:
                    raise OSError(f"short write to {path}")
                if padded != size:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)


def _header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise ValueError("truncated before header")
    (n,) = struct.unpack_from("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise ValueError("implausible header length")
    return n


def _parse_header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def _open_regular(path: Path) -> BinaryIO:
    """`path` open for reading if it is a regular file, else ValueError. The tier writes nothing else, and
    the open neither blocks (a FIFO in a block's place hung the engine thread in open()) nor follows a
    symlink (it may name a device: /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symlink
            raise ValueError("a symbolic link, not a block file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_layout(tensors: dict, shape: KVShape) -> None:
    """ValueError unless `tensors` (a header without its metadata) are a block of a store of `shape`: K and
    V of every layer it holds, each (kv_heads, block_size, head_dim) of its dtype. A block of another
    layout used to pass every check here and fail the step that loaded it (every step, after every
    restart); one of another dtype was cast, silently changing answers."""
    layers = len(tensors) // 2
    if len(tensors) % 2 or set(tensors) != {f"{kind}.{i}" for kind in "kv" for i in range(layers)}:
        raise ValueError("tensor names are not k.0.. and v.0..")
    if layers != shape.num_layers:
        raise ValueError(f"{layers} layers, a block of this store has {shape.num_layers}")
    want, want_dtype = [shape.kv_heads, shape.block_size, shape.head_dim], _NAMES[shape.dtype]
    for name in sorted(tensors):
        entry = tensors[name] if isinstance(tensors[name], dict) else {}
        if entry.get("shape") != want:
            raise ValueError(f"{name}: shape {entry.get('shape')!r}, a block of this store has {want}")
        if entry.get("dtype") != want_dtype:
            raise ValueError(f"{name}: dtype {entry.get('dtype')!r}, a block of this store has {want_dtype}")


def read_header(path: Path, shape: KVShape) -> tuple[dict, int]:
    """Parse a safetensors header of a block of a store of `shape`; return (header, expected file size).
    Raises ValueError."""
    with _open_regular(path) as f:
        n = _header_length(f.read(8))
        header = _parse_header(f.read(n))
    _check_layout({k: v for k, v in header.items() if k != "__metadata__"}, shape)
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    return header, 8 + n + end


def read_block(path: Path, shape: KVShape) -> tuple[BlockData, dict[str, str]]:
    """The block in `path` and its metadata, its checksum verified. Raises ValueError for any file that
    is not a whole, consistent block file of a store of `shape` (and OSError, e.g. FileNotFoundError,
    from reading it). A file larger than such a block can be is refused before it is read."""
    limit = 8 + MAX_HEADER_BYTES + shape.block_bytes
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:  # a 3 GB (sparse) file was read whole before its header was looked at
            raise ValueError(f"{size} bytes, a block file of this store has at most {limit}")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since the fstat
        raise ValueError(f"more than {limit} bytes, a block file of this store has at most {limit}")
    n = _header_length(data)
    if 8 + n > len(data):
        raise ValueError("implausible header length")
    header = _parse_header(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a string map")
    _check_layout(header, shape)
    layers = shape.num_layers
    body = memoryview(data)[8 + n :]
    arrays = {name: _tensor_bytes(name, header[name], body) for name in sorted(header)}
    if meta.get("checksum") != _digest((name, raw) for name, (raw, _) in arrays.items()):
        raise ValueError("checksum mismatch")
    out = {name: _to_mx(raw, dtype, header[name]["shape"]) for name, (raw, dtype) in arrays.items()}
    return BlockData([out[f"k.{i}"] for i in range(layers)], [out[f"v.{i}"] for i in range(layers)]), meta


def _tensor_bytes(name: str, entry: object, body: memoryview) -> tuple[memoryview, str]:
    if not isinstance(entry, dict):
        raise ValueError(f"{name}: not a tensor entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: unsupported dtype {dtype!r}")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 2**31 for d in shape)):
        raise ValueError(f"{name}: shape {shape!r} is not three positive sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ValueError(f"{name}: bad data offsets")
    start, end = offsets
    if not 0 <= start <= end <= len(body):
        raise ValueError(f"{name}: data outside the file")
    if end - start != math.prod(shape) * np.dtype(_DTYPES[dtype][0]).itemsize:
        raise ValueError(f"{name}: {end - start} bytes for shape {shape}")
    return body[start:end], dtype


def _to_mx(raw: memoryview, dtype: str, shape: list[int]) -> mx.array:
    np_dtype, mx_dtype = _DTYPES[dtype]
    a = mx.array(np.frombuffer(raw, dtype=np_dtype).reshape(shape))  # copies: the file buffer is not kept
    return a.view(mx_dtype) if a.dtype != mx_dtype else a
