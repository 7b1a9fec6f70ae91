"""Pipeline-stage wire format: exact round trips, a layout pinned byte for byte, and every malformed
packet a StageWireError (never another exception, never a large read before the size is checked)."""

from __future__ import annotations

import random
import struct

import mlx.core as mx
import numpy as np
import pytest

from meshlm.transport import stage_wire as sw
from meshlm.transport.stage_wire import (DEFAULT_MAX_BYTES, HEADER, VERSION, Expect, PacketHeader, StageWireError,
                                         TensorExpect, decode_packet, encode_activation, encode_kv, encode_packet,
                                         encode_tensor, read_packet)

CODES = {mx.uint8: 0, mx.int8: 1, mx.int16: 2, mx.int32: 3, mx.int64: 4, mx.float16: 5, mx.float32: 6,
         mx.float64: 7, mx.complex64: 9, mx.bool_: 11, mx.bfloat16: 15, mx.uint16: 27, mx.uint32: 28, mx.uint64: 29}
SHAPES = [(), (3,), (2, 3), (2, 1, 4), (1, 2, 3, 2), (0, 4)]
ANY = Expect()


class Stream:
    """A recv_exactly over bytes that records every request, and raises EOFError past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.asked: list[int] = []

    def __call__(self, n: int) -> bytes:
        self.asked.append(n)
        if self.pos + n > len(self.data):
            raise EOFError(f"wanted {n} bytes, {len(self.data) - self.pos} left")
        self.pos += n
        return self.data[self.pos - n:self.pos]


def raw(a: mx.array) -> bytes:
    """The array's element bytes (bfloat16 through its uint16 bits, as numpy lacks it)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def random_array(rng: np.random.Generator, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    if dtype == mx.bool_:
        return mx.array(rng.integers(0, 2, size=shape).astype(np.bool_))
    wire_np = sw._BY_MX[dtype].np  # random bits, NaNs included: the round trip must be bit-exact
    bits = np.frombuffer(rng.bytes(int(np.prod(shape)) * wire_np.itemsize), dtype=wire_np).reshape(shape)
    if dtype == mx.bfloat16:
        return mx.array(bits, dtype=mx.uint16).view(mx.bfloat16)
    return mx.array(bits, dtype=dtype)


def assert_same(got: mx.array | None, want: mx.array | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    assert raw(got) == raw(want)


def tensor_bytes(code: int, sizes: tuple[int, ...], nbytes: int, payload: bytes = b"") -> bytes:
    return b"\x01" + struct.pack(f"!ii{len(sizes)}QQ", code, len(sizes), *sizes, nbytes) + payload


def packet(*tensors: bytes, version: int = VERSION, stage_from: int = 0, stage_to: int = 1, step: int = 7,
           pos: int = 5) -> bytes:
    return HEADER.pack(version, stage_from, stage_to, step, pos) + b"".join(tensors)


# -- round trips --------------------------------------------------------------------------------------


def test_dtype_table_is_c10_scalar_type_numbering():
    assert dict(sw.DTYPE_CODES) == CODES


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_round_trip_every_dtype_and_rank(dtype):
    rng = np.random.default_rng(CODES[dtype])
    for shape in SHAPES:
        a = random_array(rng, dtype, shape)
        b = random_array(rng, dtype, shape[::-1])
        data = encode_packet(PacketHeader(VERSION, 2, 3, 11, 13), [a, b])
        header, (got_a, got_b) = decode_packet(data, ANY)
        assert header == PacketHeader(VERSION, 2, 3, 11, 13)
        assert_same(got_a, a)
        assert_same(got_b, b)
        assert read_packet(Stream(data), ANY)[1][0].shape == shape


def test_bfloat16_round_trip_is_bit_exact_for_every_pattern():
    bits = mx.arange(0, 1 << 16, dtype=mx.uint32).astype(mx.uint16)  # NaNs, infinities, subnormals, -0
    a = bits.view(mx.bfloat16)
    _, (got, _) = decode_packet(encode_activation(0, 1, 0, 0, a), ANY)
    assert got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.view(mx.uint16)), np.array(bits))


def test_float64_round_trip():
    a = mx.array(np.array([1 / 3, -2.5e300, np.inf]), dtype=mx.float64)
    _, (got, _) = decode_packet(encode_activation(0, 1, 0, 0, a), ANY)
    assert got.dtype == mx.float64 and raw(got) == raw(a)


def test_activation_with_and_without_mask():
    hidden = mx.random.normal((1, 4, 8))
    mask = mx.array([[True, True, False, True]])
    header, (h, m) = decode_packet(encode_activation(0, 1, 3, 12, hidden, mask), Expect(step=3, pos=12))
    assert header == PacketHeader(VERSION, 0, 1, 3, 12)
    assert_same(h, hidden)
    assert_same(m, mask)
    _, (h, m) = decode_packet(encode_activation(0, 1, 3, 12, hidden), ANY)
    assert_same(h, hidden)
    assert m is None


def test_kv_round_trip_with_k_only_v_only_and_neither():
    rng = np.random.default_rng(0)
    k = random_array(rng, mx.float16, (2, 1, 2, 3, 4))
    v = random_array(rng, mx.float16, (2, 1, 2, 3, 4))
    for want_k, want_v in [(k, v), (k, None), (None, v), (None, None)]:
        _, (got_k, got_v) = decode_packet(encode_kv(1, 2, 4, 0, want_k, want_v), ANY)
        assert_same(got_k, want_k)
        assert_same(got_v, want_v)


def test_encode_kv_refuses_non_5d():
    with pytest.raises(StageWireError, match="5-D"):
        encode_kv(0, 1, 0, 0, k=mx.zeros((2, 3, 4, 5)))
    with pytest.raises(StageWireError, match="v must be 5-D"):
        encode_kv(0, 1, 0, 0, v=mx.zeros((1, 1, 1, 1, 1, 1)))


def test_non_contiguous_array_is_sent_c_contiguous():
    a = mx.arange(12, dtype=mx.int32).reshape(3, 4).T
    _, (got, _) = decode_packet(encode_activation(0, 1, 0, 0, a), ANY)
    assert got.tolist() == a.tolist()
    assert encode_tensor(a)[-48:] == np.arange(12, dtype="<i4").reshape(3, 4).T.copy().tobytes()


def test_decoded_arrays_do_not_alias_the_buffer():
    buf = bytearray(encode_activation(0, 1, 0, 0, mx.arange(4, dtype=mx.float32)))
    _, (got, _) = decode_packet(buf, ANY)
    buf[-16:] = bytes(16)
    assert got.tolist() == [0, 1, 2, 3]


def test_read_packet_reads_consecutive_packets_from_one_stream():
    hidden, k = mx.ones((1, 2, 4)), mx.zeros((1, 1, 1, 2, 4))
    stream = Stream(encode_activation(0, 1, 9, 2, hidden) + encode_kv(0, 1, 9, 2, k))
    _, (h, m) = read_packet(stream, Expect(step=9))
    _, (got_k, v) = read_packet(stream, Expect(step=9))
    assert_same(h, hidden)
    assert_same(got_k, k)
    assert m is None and v is None and stream.pos == len(stream.data)
    assert 0 not in stream.asked  # a 0-D or undefined tensor never asks the stream for nothing


# -- the layout, byte for byte ----------------------------------------------------------------------------


def test_header_bytes_are_big_endian_iiiqq():
    data = encode_activation(3, 4, 2**40 + 1, 2**33 + 7, mx.zeros((1,)))
    assert HEADER.size == 28
    assert data[:28] == struct.pack("!iiiQQ", 1, 3, 4, 2**40 + 1, 2**33 + 7)
    assert data[:28] == bytes.fromhex("00000001" "00000003" "00000004" "0000010000000001" "0000000200000007")


def test_tensor_bytes_are_pinned():
    a = mx.array([[1, 2, 3]], dtype=mx.int32)
    want = (b"\x01" + bytes.fromhex("00000003" "00000002") + bytes.fromhex("0000000000000001" "0000000000000003")
            + bytes.fromhex("000000000000000c") + bytes.fromhex("01000000" "02000000" "03000000"))
    assert encode_tensor(a) == want
    assert encode_tensor(None) == b"\x00"
    assert encode_tensor(mx.array(1.0, dtype=mx.bfloat16)) == b"\x01" + bytes.fromhex("0000000f" "00000000"
                                                                                       "0000000000000002") + b"\x80\x3f"
    assert encode_activation(0, 1, 7, 5, a) == packet(want, b"\x00")


# -- truncation and trailing bytes ----------------------------------------------------------------------


def test_truncated_header():
    data = encode_activation(0, 1, 0, 0, mx.zeros((2,)))
    for n in range(HEADER.size):
        with pytest.raises(StageWireError, match="truncated stage packet header"):
            decode_packet(data[:n], ANY)


def test_every_prefix_of_a_packet_is_a_stage_wire_error():
    data = encode_activation(1, 2, 0, 0, mx.arange(6, dtype=mx.float16).reshape(2, 3), mx.array([True, False]))
    for n in range(len(data)):
        with pytest.raises(StageWireError) as e:
            decode_packet(data[:n], ANY)
        assert "truncated" in str(e.value)
        if n >= HEADER.size:
            assert "from stage 1" in str(e.value)


def test_truncation_in_read_packet_is_the_streams_error():
    data = encode_activation(0, 1, 0, 0, mx.zeros((4,)))
    for n in (0, 10, HEADER.size, HEADER.size + 5, len(data) - 1):
        with pytest.raises(EOFError):
            read_packet(Stream(data[:n]), ANY)


def test_errors_from_recv_exactly_propagate_unchanged():
    def broken(n: int) -> bytes:
        raise ConnectionResetError("peer reset")
    with pytest.raises(ConnectionResetError, match="peer reset"):
        read_packet(broken, ANY)


def test_short_read_from_recv_exactly_is_refused():
    with pytest.raises(StageWireError, match="returned 3 bytes"):
        read_packet(lambda n: b"abc", ANY)


def test_trailing_bytes():
    data = encode_activation(2, 3, 0, 0, mx.zeros((2,)))
    with pytest.raises(StageWireError, match="packet from stage 2 to stage 3 has 1 trailing bytes"):
        decode_packet(data + b"\x00", ANY)
    with pytest.raises(StageWireError, match="trailing"):  # three tensors where two were expected
        decode_packet(data + b"\x00", ANY, slots=2)
    assert decode_packet(data + b"\x00", ANY, slots=3)[1][2] is None


# -- header validation -------------------------------------------------------------------------------------


def test_wrong_version():
    data = packet(b"\x00", b"\x00", version=2, stage_from=1)
    with pytest.raises(StageWireError, match="from stage 1 speaks stage wire version 2, this build speaks 1"):
        decode_packet(data, ANY)
    with pytest.raises(StageWireError, match="version 2"):
        read_packet(Stream(data), ANY)


def test_wrong_version_is_refused_before_any_tensor_byte_is_read():
    stream = Stream(packet(tensor_bytes(6, (10,), 40, bytes(40)), version=0))
    with pytest.raises(StageWireError, match="version 0"):
        read_packet(stream, ANY)
    assert stream.asked == [HEADER.size]


@pytest.mark.parametrize("field, want, got", [("stage_from", 0, 1), ("stage_to", 2, 1), ("step", 7, 9),
                                              ("pos", 4, 5)])
def test_header_mismatch(field, want, got):
    data = encode_activation(1, 1, 9, 5, mx.zeros((1,)))
    with pytest.raises(StageWireError, match=f"packet from stage 1 to stage 1: expected {field} {want}, got {got}"):
        decode_packet(data, Expect(**{field: want}))
    stream = Stream(data)
    with pytest.raises(StageWireError, match=f"expected {field}"):
        read_packet(stream, Expect(**{field: want}))
    assert stream.asked == [HEADER.size]


def test_matching_header_passes():
    data = encode_activation(1, 2, 9, 5, mx.zeros((1,)))
    assert decode_packet(data, Expect(stage_from=1, stage_to=2, step=9, pos=5))[0].step == 9


@pytest.mark.parametrize("stage_from, stage_to", [(-1, 1), (1, -1), (-(2**31), 0)])
def test_negative_stage_numbers(stage_from, stage_to):
    with pytest.raises(StageWireError, match="outside 0.."):
        decode_packet(packet(b"\x00", b"\x00", stage_from=stage_from, stage_to=stage_to), ANY)


def test_packet_header_refuses_what_the_wire_cannot_carry():
    for bad in [dict(stage_from=-1), dict(stage_to=2**31), dict(step=-1), dict(pos=2**64), dict(version=2**31),
                dict(step=1.0), dict(stage_from=True)]:
        fields = dict(version=VERSION, stage_from=0, stage_to=1, step=0, pos=0) | bad
        with pytest.raises(StageWireError):
            PacketHeader(**fields)
    with pytest.raises(StageWireError):
        encode_activation(0, -1, 0, 0, mx.zeros((1,)))


# -- tensor validation ---------------------------------------------------------------------------------------


def decode_error(*tensors: bytes, expect: Expect = ANY, slots: int = 2) -> str:
    with pytest.raises(StageWireError) as e:
        decode_packet(packet(*tensors), expect, slots)
    assert "packet from stage 0 to stage 1" in str(e.value)
    return str(e.value)


def test_defined_flag_must_be_0_or_1():
    assert "defined flag is 2" in decode_error(b"\x02", b"\x00")


@pytest.mark.parametrize("code", [-1, 8, 10, 12, 16, 26, 30, 1000])
def test_unknown_dtype_code(code):
    assert f"unknown dtype code {code}" in decode_error(tensor_bytes(code, (1,), 4, bytes(4)), b"\x00")


@pytest.mark.parametrize("ndim", [-1, 9, 2**31 - 1, -(2**31)])
def test_absurd_ndim(ndim):
    data = b"\x01" + struct.pack("!ii", 6, ndim) + bytes(100)
    assert f"ndim {ndim} is outside 0..8" in decode_error(data, b"\x00")


def test_nbytes_must_match_sizes():
    assert "announces 8 payload bytes, but float32 (3,) needs 12" in decode_error(
        tensor_bytes(6, (3,), 8, bytes(8)), b"\x00")
    assert "needs 12" in decode_error(tensor_bytes(6, (3,), 16, bytes(16)), b"\x00")
    assert "needs 0" in decode_error(tensor_bytes(6, (0, 5), 4, bytes(4)), b"\x00")


def test_sizes_must_fit():
    assert "axis 1 has size 2147483648" in decode_error(tensor_bytes(0, (1, 2**31), 2**31), b"\x00")
    assert "axis 0 has size 18446744073709551615" in decode_error(tensor_bytes(0, (2**64 - 1,), 0), b"\x00")
    # an empty tensor whose other axes would overflow strides
    assert "absurd" in decode_error(tensor_bytes(6, (0,) + (2**31 - 1,) * 7, 0), b"\x00")


def test_bool_payload_must_be_0_or_1():
    assert "bool tensor" in decode_error(tensor_bytes(11, (3,), 3, b"\x00\x01\x02"), b"\x00")


def test_required_tensor_undefined():
    expect = Expect(tensors=(TensorExpect(), TensorExpect(required=False)))
    assert "tensor 0: required tensor is undefined" in decode_error(b"\x00", b"\x00", expect=expect)
    hidden, _ = decode_packet(encode_activation(0, 1, 0, 0, mx.zeros((1,))), expect)[1]
    assert hidden is not None


def test_dtype_and_shape_against_expect():
    data = encode_activation(0, 1, 0, 0, mx.zeros((1, 4, 8), dtype=mx.float16), mx.zeros((4,), dtype=mx.bool_))
    ok = Expect(tensors=(TensorExpect(mx.float16, (1, None, 8)), TensorExpect(mx.bool_, (None,), required=False)))
    assert decode_packet(data, ok)[1][0].shape == (1, 4, 8)
    bad_dtype = Expect(tensors=(TensorExpect(mx.bfloat16), TensorExpect(required=False)))
    with pytest.raises(StageWireError, match="tensor 0: expected dtype bfloat16, got float16"):
        decode_packet(data, bad_dtype)
    for shape in [(1, 4), (1, 5, 8), (1, 4, 8, 1), (2, None, None)]:
        with pytest.raises(StageWireError, match="tensor 0: expected shape"):
            decode_packet(data, Expect(tensors=(TensorExpect(shape=shape), TensorExpect(required=False))))
    with pytest.raises(StageWireError, match=r"tensor 1: expected shape \(5,\), got \(4,\)"):
        decode_packet(data, Expect(tensors=(TensorExpect(), TensorExpect(shape=(5,)))))


def test_expect_must_describe_every_slot():
    with pytest.raises(ValueError, match="2 tensor slots but 1"):
        decode_packet(encode_activation(0, 1, 0, 0, mx.zeros((1,))), Expect(tensors=(TensorExpect(),)))


# -- size caps: checked before the payload is read ------------------------------------------------------------


def test_tensor_over_max_bytes_is_refused_before_its_payload_is_read():
    meta = tensor_bytes(6, (100,), 400)  # no payload follows: reading it would be an EOFError, not our error
    stream = Stream(packet(meta))
    with pytest.raises(StageWireError, match="tensor 0: 400 bytes is over the limit of 399"):
        read_packet(stream, Expect(max_bytes=399))
    assert 400 not in stream.asked and sum(stream.asked) == len(stream.data)


def test_huge_tensor_is_refused_before_its_payload_is_read():
    stream = Stream(packet(tensor_bytes(0, (2**20, 2**20), 2**40)))  # 1 TiB
    with pytest.raises(StageWireError, match="over the limit"):
        read_packet(stream, ANY)
    assert max(stream.asked) == HEADER.size


def test_packet_total_over_max_bytes_is_refused_before_the_second_payload():
    first = tensor_bytes(6, (75,), 300, bytes(300))
    second = tensor_bytes(6, (75,), 300)
    stream = Stream(packet(first, second))
    with pytest.raises(StageWireError, match="tensor 1: the packet's tensors total 600 bytes, over the limit of 500"):
        read_packet(stream, Expect(max_bytes=500))
    assert stream.asked.count(300) == 1 and stream.pos == len(stream.data)
    with pytest.raises(StageWireError, match="total 600"):
        decode_packet(packet(first, second + bytes(300)), Expect(max_bytes=500))


def test_packet_at_exactly_max_bytes_passes():
    data = packet(tensor_bytes(6, (75,), 300, bytes(300)), tensor_bytes(6, (50,), 200, bytes(200)))
    assert decode_packet(data, Expect(max_bytes=500))[1][1].shape == (50,)
    assert DEFAULT_MAX_BYTES == 1 << 30


# -- garbage ------------------------------------------------------------------------------------------------


def decode_or_wire_error(data: bytes, expect: Expect = ANY) -> None:
    try:
        decode_packet(data, expect)
    except StageWireError:
        pass
    try:
        read_packet(Stream(data), expect)
    except (StageWireError, EOFError):
        pass


def test_random_garbage_only_raises_stage_wire_error():
    rng = random.Random(1234)
    for _ in range(300):
        decode_or_wire_error(rng.randbytes(rng.randrange(0, 200)))
    for _ in range(300):  # a valid header, so the tensor decoding is what meets the garbage
        tail = rng.randbytes(rng.randrange(0, 120))
        decode_or_wire_error(packet(tail), Expect(max_bytes=1 << 20))
    for _ in range(300):  # plausible metadata, so the size checks and the payload conversion meet it too
        code = rng.choice([*CODES.values(), rng.randrange(-5, 40)])
        sizes = tuple(rng.randrange(0, 4) for _ in range(rng.randrange(0, 4)))
        nbytes = int(np.prod(sizes)) * rng.choice([1, 2, 4, 8]) + rng.choice([0, 0, 1, -1])
        payload = rng.randbytes(max(0, nbytes + rng.choice([0, 0, -1, 1])))
        second = rng.randbytes(rng.randrange(3))
        decode_or_wire_error(packet(tensor_bytes(code, sizes, max(0, nbytes), payload), second))


def test_mutated_packets_only_raise_stage_wire_error():
    rng = random.Random(99)
    base = encode_kv(0, 1, 2, 3, mx.zeros((1, 1, 2, 3, 4), dtype=mx.bfloat16), mx.ones((1, 1, 2, 3, 4)))
    expect = Expect(tensors=(TensorExpect(required=False), TensorExpect(shape=(1, 1, 2, None, 4))))
    for _ in range(300):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(HEADER.size, len(data))] = rng.randrange(256)
        cut = rng.choice([len(data), rng.randrange(len(data))])
        decode_or_wire_error(bytes(data[:cut]), expect)


def test_encode_refuses_what_is_not_an_mlx_array():
    with pytest.raises(TypeError):
        encode_tensor(np.zeros(3))
    with pytest.raises(TypeError):
        encode_activation(0, 1, 0, 0, None)
