"""The SSD block reader trusts nothing in a file: every malformed file is a ValueError, never a crash."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from meshlm.kv.blockfile import ALIGN, MAX_HEADER_BYTES, DirectWriter, checksum, read_block, read_header, write_block
from meshlm.kv.store import KVShape


def kv_shape(layers: int = 2, dims: tuple[int, int, int] = (2, 4, 8), dtype=mx.float32) -> KVShape:
    """The store whose blocks are `layers` arrays of `dims` (kv_heads, block_size, head_dim) for K and V."""
    heads, block_size, head_dim = dims
    return KVShape(layers, heads, head_dim, block_size, dtype)


def _write(tmp_path: Path, layers: int = 2, dtype=mx.float32, meta: dict | None = None,
           dims: tuple[int, int, int] = (2, 4, 8)) -> tuple[Path, dict]:
    arrays = {}
    for i in range(layers):
        arrays[f"k.{i}"] = mx.random.normal(dims).astype(dtype)
        arrays[f"v.{i}"] = mx.random.normal(dims).astype(dtype)
    path = tmp_path / "block.safetensors"
    mx.save_safetensors(str(path), arrays, metadata=meta if meta is not None else
                        {"format": "x", "checksum": checksum(arrays)})
    return path, arrays


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip(tmp_path, dtype):
    path, arrays = _write(tmp_path, dtype=dtype)
    block, meta = read_block(path, kv_shape(dtype=dtype))
    assert meta["format"] == "x"
    assert len(block.keys) == len(block.values) == 2
    for i in range(2):
        assert block.keys[i].dtype == dtype and block.keys[i].shape == (2, 4, 8)
        assert mx.array_equal(block.keys[i], arrays[f"k.{i}"])
        assert mx.array_equal(block.values[i], arrays[f"v.{i}"])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_written_blocks_are_safetensors_that_mlx_and_the_reader_read_back(tmp_path, dtype):
    arrays = {f"{kind}.{i}": mx.random.normal((3, 4, 8)).astype(dtype) for kind in "kv" for i in range(3)}
    arrays["k.1"] = mx.random.normal((4, 3, 8)).astype(dtype).transpose(1, 0, 2)  # a strided view is written whole
    path = tmp_path / "block.safetensors"
    write_block(path, arrays, {"format": "x", "rank": "0"})
    assert (8 + struct.unpack_from("<Q", path.read_bytes())[0]) % 8 == 0  # tensor data 8-byte aligned
    loaded, meta = mx.load(str(path), return_metadata=True)
    assert meta == {"format": "x", "rank": "0", "checksum": checksum(arrays)}
    block, meta2 = read_block(path, kv_shape(3, (3, 4, 8), dtype))
    assert meta2 == meta
    for name, a in arrays.items():
        got = (block.keys if name[0] == "k" else block.values)[int(name[2:])]
        assert loaded[name].dtype == got.dtype == dtype
        assert mx.array_equal(loaded[name], a).item() and mx.array_equal(got, a).item()


def test_the_writer_refuses_dtypes_block_files_do_not_hold(tmp_path):
    with pytest.raises(ValueError, match="int32"):
        write_block(tmp_path / "b.safetensors", {"k.0": mx.zeros((1, 1, 1), dtype=mx.int32)}, {})
    assert not (tmp_path / "b.safetensors").exists()


def test_checksum_mismatch(tmp_path):
    path, _ = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        read_block(path, kv_shape())


def test_missing_checksum(tmp_path):
    path, _ = _write(tmp_path, meta={"format": "x"})
    with pytest.raises(ValueError, match="checksum"):
        read_block(path, kv_shape())


@pytest.mark.parametrize("raw", [b"", b"\x01\x02", struct.pack("<Q", 2**40), struct.pack("<Q", 100) + b"{}"])
def test_truncated_or_implausible_header(tmp_path, raw):
    path = tmp_path / "b.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ValueError):
        read_block(path, kv_shape())


@pytest.mark.parametrize("header", [b"not json", b"\xff\xfe", b"[1, 2]", b'{"__metadata__": {"a": 1}}'])
def test_bad_header(tmp_path, header):
    path = tmp_path / "b.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError):
        read_block(path, kv_shape())


def _mutate(tmp_path, change):
    path, _ = _write(tmp_path)
    header, body = _split(path)
    change(header)
    _join(path, header, body)
    with pytest.raises(ValueError):
        read_block(path, kv_shape())


def test_wrong_tensor_names(tmp_path):
    _mutate(tmp_path, lambda h: h.update({"x.0": h.pop("k.0")}))


def test_missing_tensor(tmp_path):
    _mutate(tmp_path, lambda h: h.pop("v.1"))


def test_offsets_outside_the_file(tmp_path):
    _mutate(tmp_path, lambda h: h["k.0"].update(data_offsets=[0, 10**9]))


def test_negative_offsets(tmp_path):
    _mutate(tmp_path, lambda h: h["k.0"].update(data_offsets=[-8, 0]))


def test_size_does_not_match_shape(tmp_path):
    _mutate(tmp_path, lambda h: h["k.0"].update(data_offsets=[h["k.0"]["data_offsets"][0] + 4,
                                                             h["k.0"]["data_offsets"][1]]))


@pytest.mark.parametrize("shape", [[2, 4], [0, 4, 8], [2, -4, 8], "x", [2, 4, True]])
def test_bad_shape(tmp_path, shape):
    _mutate(tmp_path, lambda h: h["k.0"].update(shape=shape))


@pytest.mark.parametrize("dtype", ["I64", "F64", None, 3])
def test_unsupported_dtype(tmp_path, dtype):
    _mutate(tmp_path, lambda h: h["k.0"].update(dtype=dtype))


def test_entry_not_a_dict(tmp_path):
    _mutate(tmp_path, lambda h: h.update({"k.0": [1, 2]}))


@pytest.mark.timeout(10)  # a FIFO opened for a blocking read hangs here for good
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_only_regular_files_are_read(tmp_path, kind):
    good, _ = _write(tmp_path)
    path = tmp_path / "odd.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(good)  # even one to a good block: the tier writes no links, and one may name a device
    for read in (read_block, read_header):
        with pytest.raises(ValueError, match="not a regular file|symbolic link"):
            read(path, kv_shape())


def test_a_file_larger_than_a_block_of_the_store_is_refused_unread(tmp_path):
    path, _ = _write(tmp_path)
    os.truncate(path, 8 + MAX_HEADER_BYTES + kv_shape().block_bytes + 1)  # the block, then (sparse) zeros
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="at most"):
            read_block(path, kv_shape())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # nothing like the file's 16 MiB was read


@pytest.mark.parametrize("layers, dims", [(1, (2, 4, 8)), (3, (2, 4, 8)), (2, (2, 2, 8)), (2, (4, 4, 8))],
                         ids=["fewer_layers", "more_layers", "shorter_blocks", "more_heads"])
def test_a_block_of_another_layout_is_refused(tmp_path, layers, dims):
    """Whole, consistent, checksum right: only the store's shape tells it from a good block."""
    path, _ = _write(tmp_path, layers=layers, dims=dims)
    for read in (read_block, read_header):
        with pytest.raises(ValueError, match="layers, a block of this store has 2|shape .*, a block of this store has"):
            read(path, kv_shape())


@pytest.mark.parametrize("written, store", [(mx.float16, mx.float32), (mx.float32, mx.bfloat16),
                                            (mx.bfloat16, mx.float16)])
def test_a_block_of_another_dtype_is_refused_not_cast(tmp_path, written, store):
    path, _ = _write(tmp_path, dtype=written)
    for read in (read_block, read_header):
        with pytest.raises(ValueError, match="dtype .*, a block of this store has"):
            read(path, kv_shape(dtype=store))


def test_copies_do_not_alias_the_file_buffer(tmp_path):
    path, arrays = _write(tmp_path)
    block, _ = read_block(path, kv_shape())
    path.write_bytes(b"")
    assert np.array_equal(np.array(block.keys[0]), np.array(arrays["k.0"]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_host_copies_are_written_as_their_mlx_twins_are(tmp_path, dtype):
    """The SSD writer takes numpy copies (KVStore.extract(host=True)): the same file, byte for byte."""
    rng = np.random.default_rng(0)
    host = {f"{kind}.{i}": rng.standard_normal((2, 4, 8)).astype(dtype) for kind in "kv" for i in range(2)}
    write_block(tmp_path / "np.safetensors", host, {"format": "x"})
    write_block(tmp_path / "mx.safetensors", {n: mx.array(a) for n, a in host.items()}, {"format": "x"})
    assert (tmp_path / "np.safetensors").read_bytes() == (tmp_path / "mx.safetensors").read_bytes()
    block, _ = read_block(tmp_path / "np.safetensors", kv_shape(dtype=mx.array(host["k.0"]).dtype))
    assert np.array_equal(np.array(block.values[1]), host["v.1"])


@pytest.mark.parametrize("direct", [True, False])
def test_the_direct_writer_writes_what_write_block_does_with_aligned_data(tmp_path, direct):
    """The SSD tier's writer: around the page cache (O_DIRECT, where the file system has it) or, as on
    macOS, through it; either way a safetensors file MLX and the reader read back, whose tensor data
    starts 4 KiB-aligned, with the same tensors and checksum as `write_block`'s, and its buffer reused."""
    rng = np.random.default_rng(1)
    writer = DirectWriter()
    writer.direct = writer.direct and direct
    for i, shape in enumerate([(3, 5, 8), (2, 4, 8), (4, 32, 64)]):  # sizes that are and are not 4 KiB multiples
        host = {f"{kind}.{j}": rng.standard_normal(shape).astype(np.float32) for kind in "kv" for j in range(2)}
        path = tmp_path / f"{i}.safetensors"
        writer.write(path, host, {"format": "x"})
        write_block(tmp_path / "plain.safetensors", host, {"format": "x"})
        (n,) = struct.unpack_from("<Q", path.read_bytes())
        assert (8 + n) % ALIGN == 0
        assert path.stat().st_size == 8 + n + sum(a.nbytes for a in host.values())  # no padding at the end
        loaded, meta = mx.load(str(path), return_metadata=True)
        block, meta2 = read_block(path, kv_shape(2, shape))
        assert meta == meta2 == read_block(tmp_path / "plain.safetensors", kv_shape(2, shape))[1]
        for name, a in host.items():
            got = (block.keys if name[0] == "k" else block.values)[int(name[2:])]
            assert np.array_equal(np.array(loaded[name]), a) and np.array_equal(np.array(got), a)


def test_the_direct_writer_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A file system without O_DIRECT answers EINVAL at open: the writer goes through the page cache
    from then on, and the file is still written."""
    import errno
    import os

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    writer = DirectWriter()
    host = {"k.0": np.ones((2, 4, 8), np.float32), "v.0": np.zeros((2, 4, 8), np.float32)}
    writer.write(tmp_path / "b.safetensors", host, {"format": "x"})
    assert not writer.direct
    block, _ = read_block(tmp_path / "b.safetensors", kv_shape(1))
    assert np.array_equal(np.array(block.keys[0]), host["k.0"])
