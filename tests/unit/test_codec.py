"""Control-plane codec: exact round trips, and every malformed input is a ProtocolError."""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest

from meshlm.engine.plan import Chunk, NewSequence, StepPlan
from meshlm.engine.request import SamplingParams
from meshlm.parallel import codec
from meshlm.parallel.codec import (
    HEADER_SIZE,
    Ack,
    Frame,
    FrameDecoder,
    Hello,
    Kind,
    ProtocolError,
    Welcome,
    decode_ack,
    decode_frame,
    decode_hello,
    decode_plan,
    decode_reason,
    decode_welcome,
    encode_ack,
    encode_frame,
    encode_hello,
    encode_plan,
    encode_reason,
    encode_welcome,
)

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
TEXTS = ["", "stop", "\n\n", "ünïcødé ✓", "🙂", "lone \ud800 surrogate", "a\x00b"]


# -- random plans (hypothesis is not installed: seeded random instead) ------------


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choice([rng.randrange(0, 50_000), rng.randint(*I32)]) for _ in range(n))


def random_params(rng: random.Random) -> SamplingParams:
    kwargs = dict(
        max_tokens=rng.choice([1, 16, rng.randrange(1, 2**40)]),
        temperature=rng.choice([0.0, 0.7, 1.0, rng.uniform(0, 2)]),
        top_p=rng.choice([1.0, rng.uniform(1e-9, 1)]),
        top_k=rng.choice([0, 1, 40, rng.randrange(0, 2**62), 10**30]),
        min_p=rng.choice([0.0, 1.0, rng.random()]),
        seed=rng.choice([None, 0, -1, rng.randint(*I64), 2**64, -(10**40)]),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        logprobs=rng.choice([None, 0, rng.randrange(0, 21)]),
        stop=tuple(rng.choice(TEXTS) for _ in range(rng.randrange(0, 5))),
        stop_token_ids=random_ids(rng, rng.randrange(0, 4)),
        ignore_eos=rng.random() < 0.5,
    )
    # Guard: a new SamplingParams field must be added here *and* to the codec.
    assert set(kwargs) == {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**kwargs)


def random_plan(rng: random.Random) -> StepPlan:
    new = tuple(
        NewSequence(
            uid=rng.randint(*I64),
            cached_len=rng.randrange(0, 2**40),
            params=random_params(rng),
            prefix_ids=random_ids(rng, rng.choice([0, 0, 16, rng.randrange(0, 300)])),
        )
        for _ in range(rng.randrange(0, 4))
    )
    chunks = tuple(
        Chunk(
            uid=rng.randint(*I64),
            start=rng.randrange(0, 2**40),
            token_ids=random_ids(rng, rng.choice([0, 1, rng.randrange(0, 2000)])),
            sample=rng.random() < 0.5,
        )
        for _ in range(rng.randrange(0, 6))
    )
    removed = tuple(rng.randint(*I64) for _ in range(rng.randrange(0, 4)))
    return StepPlan(rng.randrange(0, 2**64), new, chunks, removed, rng.randrange(0, 2**64))


def test_random_plans_round_trip_exactly():
    rng = random.Random(1234)
    for _ in range(300):
        plan = random_plan(rng)
        back = decode_plan(encode_plan(plan))
        assert back == plan
        assert all(isinstance(c.token_ids, tuple) for c in back.chunks)


def test_codec_covers_every_plan_field():
    # A new field on these dataclasses must be encoded explicitly (and added to random_plan).
    assert [f.name for f in dataclasses.fields(StepPlan)] == ["step_id", "new", "chunks", "removed", "fingerprint"]
    assert [f.name for f in dataclasses.fields(NewSequence)] == ["uid", "cached_len", "params", "prefix_ids"]
    assert [f.name for f in dataclasses.fields(Chunk)] == ["uid", "start", "token_ids", "sample"]


def test_edge_plans_round_trip():
    empty = StepPlan(step_id=0)
    assert decode_plan(encode_plan(empty)) == empty
    extremes = StepPlan(
        step_id=2**64 - 1,
        chunks=(Chunk(I64[0], 0, (I32[0], I32[1], 0), sample=True),),
        removed=(I64[0], I64[1]),
        fingerprint=2**64 - 1,
    )
    assert decode_plan(encode_plan(extremes)) == extremes


def test_client_chosen_integers_of_any_size_round_trip():
    # The API accepts any JSON integer as seed or top_k; the broadcast must not fail on one.
    for big in (2**63, -(2**63) - 1, 10**1000, -(10**1000)):
        p = SamplingParams(seed=big, top_k=abs(big), max_tokens=abs(big))
        plan = StepPlan(0, new=(NewSequence(1, 0, p),))
        assert decode_plan(encode_plan(plan)) == plan


def test_float_params_keep_every_bit():
    p = SamplingParams(temperature=0.1 + 0.2, top_p=5e-324, min_p=1 / 3, presence_penalty=-0.0)
    back = decode_plan(encode_plan(StepPlan(0, new=(NewSequence(1, 0, p),)))).new[0].params
    assert struct.pack("<dddd", back.temperature, back.top_p, back.min_p, back.presence_penalty) == struct.pack(
        "<dddd", p.temperature, p.top_p, p.min_p, p.presence_penalty
    )


def test_large_chunk_is_packed_int32():
    ids = tuple(range(200_000))
    payload = encode_plan(StepPlan(1, chunks=(Chunk(7, 0, ids, sample=True),)))
    assert len(payload) < 4 * len(ids) + 100
    assert decode_plan(payload).chunks[0].token_ids == ids


def test_other_messages_round_trip():
    hello = Hello(rank=3, world_size=4, fingerprint="sha256:abc/ünï")
    assert decode_hello(encode_hello(hello)) == hello
    welcome = Welcome(world_size=4, fingerprint="x")
    assert decode_welcome(encode_welcome(welcome)) == welcome
    ack = Ack(step_id=2**64 - 1, fingerprint=12345, error="KeyError: uid 3")
    assert decode_ack(encode_ack(ack)) == ack
    assert decode_reason(encode_reason("bye \ud800")) == "bye \ud800"


# -- frames ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind))
def test_frames_round_trip_for_every_kind(kind):
    data = encode_frame(kind, 2**64 - 1, b"payload \x00\xff")
    assert len(data) == HEADER_SIZE + 10
    assert decode_frame(data) == Frame(kind, 2**64 - 1, b"payload \x00\xff")


def test_header_layout_is_documented_one():
    data = encode_frame(Kind.PLAN, 5, b"abc")
    magic, version, kind, flags, seq, length = struct.unpack_from("<4sHBBQI", data)
    assert (magic, version, kind, flags, seq, length) == (b"MLCP", codec.VERSION, 4, 0, 5, 3)
    assert HEADER_SIZE == 28


def test_stream_decoder_byte_by_byte():
    frames = [encode_frame(Kind.HEARTBEAT, 0), encode_frame(Kind.PLAN, 1, b"x" * 1000), encode_frame(Kind.SHUTDOWN, 2)]
    dec = FrameDecoder()
    out = []
    for byte in b"".join(frames):
        dec.feed(bytes([byte]))
        while (f := dec.next_frame()) is not None:
            out.append(f)
    got = [(f.kind, f.seq, len(f.payload)) for f in out]
    assert got == [(Kind.HEARTBEAT, 0, 0), (Kind.PLAN, 1, 1000), (Kind.SHUTDOWN, 2, 0)]
    assert dec.buffered == 0


def test_stream_decoder_refuses_oversized_frame_before_its_payload_arrives():
    dec = FrameDecoder(max_payload=1024)
    dec.feed(encode_frame(Kind.PLAN, 0, b"x" * 2048)[:HEADER_SIZE])
    with pytest.raises(ProtocolError, match="limit is 1024"):
        dec.next_frame()


def _patched(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


GOOD = encode_frame(Kind.PLAN, 7, encode_plan(StepPlan(3, chunks=(Chunk(1, 0, (1, 2, 3), True),))))

MALFORMED_FRAMES = {
    "empty": (b"", "truncated frame header"),
    "short header": (GOOD[:HEADER_SIZE - 1], "truncated frame header"),
    "bad magic": (b"HTTP" + GOOD[4:], "bad magic"),
    "wrong version": (_patched(GOOD, 4, "<H", 2), "protocol version 2"),
    "unknown kind": (_patched(GOOD, 6, "<B", 99), "unknown frame kind 99"),
    "flags set": (_patched(GOOD, 7, "<B", 1), "unsupported frame flags"),
    "truncated payload": (GOOD[:-1], "truncated PLAN frame"),
    "trailing garbage": (GOOD + b"\x00", "trailing garbage"),
    "length too small": (_patched(GOOD, 16, "<I", len(GOOD) - HEADER_SIZE - 1), "trailing garbage"),
    "length too large": (_patched(GOOD, 16, "<I", len(GOOD) - HEADER_SIZE + 1), "truncated PLAN frame"),
    "oversized": (_patched(GOOD, 16, "<I", 2**32 - 1), "limit is"),
    "payload bit flip": (GOOD[:-2] + bytes([GOOD[-2] ^ 0x01]) + GOOD[-1:], "checksum mismatch"),
    "seq bit flip": (_patched(GOOD, 8, "<Q", 8), "checksum mismatch"),
    "checksum bit flip": (GOOD[:20] + bytes([GOOD[20] ^ 0x01]) + GOOD[21:], "checksum mismatch"),
}


@pytest.mark.parametrize("name", list(MALFORMED_FRAMES))
def test_malformed_frames_raise_protocol_error(name):
    data, message = MALFORMED_FRAMES[name]
    with pytest.raises(ProtocolError, match=message):
        decode_frame(data)


def test_configurable_payload_limit():
    with pytest.raises(ProtocolError, match="limit is 16"):
        decode_frame(encode_frame(Kind.PLAN, 0, b"x" * 17), max_payload=16)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        encode_frame(Kind.PLAN, 0, b"x" * 17, max_payload=16)


def test_encode_frame_refuses_bad_kind_and_seq():
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        encode_frame(42, 0, b"")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="u64"):
        encode_frame(Kind.PLAN, -1, b"")


def test_random_garbage_and_mutations_only_ever_raise_protocol_error():
    rng = random.Random(99)
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80))) for _ in range(300)]
    for _ in range(1000):
        b = bytearray(GOOD)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        samples.append(bytes(b))
    for data in samples:
        try:
            decode_frame(data)
        except ProtocolError:
            pass


# -- payloads ---------------------------------------------------------------------------

PLAN = encode_plan(
    StepPlan(
        4,
        new=(NewSequence(9, 2, SamplingParams(seed=1, logprobs=2, stop=("x",), stop_token_ids=(5,)), (1, 2)),),
        chunks=(Chunk(9, 2, (3, 4), True),),
        removed=(1,),
        fingerprint=77,
    )
)


def test_every_truncation_of_a_plan_is_a_protocol_error():
    for n in range(len(PLAN)):
        with pytest.raises(ProtocolError, match="truncated PLAN payload"):
            decode_plan(PLAN[:n])


def test_trailing_bytes_in_a_plan_are_refused():
    with pytest.raises(ProtocolError, match="trailing garbage in PLAN"):
        decode_plan(PLAN + b"\x00")


def test_random_plan_mutations_only_ever_raise_protocol_error():
    rng = random.Random(7)
    for _ in range(3000):
        b = bytearray(PLAN)
        for _ in range(rng.randrange(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            decode_plan(bytes(b))
        except ProtocolError:
            pass


def _plan_with_params(*, top_p: float = 1.0, bool_byte: int = 0, stop: bytes = b"x", count: int = 0) -> bytes:
    """A one-sequence PLAN written field by field, so a test can put bytes there the encoder never would."""
    w = codec._Writer()
    for v in (0, 0):  # step_id, fingerprint
        w.u64(v)
    w.u32(1)  # one new sequence
    w.i64(1)  # uid
    w.u64(0)  # cached_len
    w.int32s(())  # prefix_ids
    w.big(16)  # max_tokens
    for v in (1.0, top_p):  # temperature, top_p
        w.f64(v)
    w.big(0)  # top_k
    w.f64(0.0)  # min_p
    w.opt_big(None)  # seed
    for v in (0.0, 0.0):  # presence, frequency penalty
        w.f64(v)
    w.opt_big(None)  # logprobs
    w.u32(1)  # one stop string, raw bytes
    w.u32(len(stop))
    w.buf += stop
    w.u32(count)  # stop_token_ids count (no ids follow)
    w.u8(bool_byte)  # ignore_eos
    w.u32(0)  # no chunks
    w.int64s(())  # removed
    return bytes(w.buf)


def test_params_helper_matches_the_encoder():
    assert _plan_with_params() == encode_plan(
        StepPlan(0, new=(NewSequence(1, 0, SamplingParams(stop=("x",))),))
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=0.0), "invalid sampling parameters.*top_p"),
        (dict(top_p=float("nan")), "invalid sampling parameters"),
        (dict(bool_byte=2), "bad boolean byte 2"),
        (dict(stop=b"\xff\xfe"), "invalid UTF-8"),
        (dict(count=2**32 - 1), "truncated PLAN payload"),  # an absurd count is not pre-allocated
    ],
)
def test_semantically_bad_plans_are_protocol_errors(kwargs, message):
    with pytest.raises(ProtocolError, match=message):
        decode_plan(_plan_with_params(**kwargs))


@pytest.mark.parametrize(
    "plan, message",
    [
        (StepPlan(0, chunks=(Chunk(1, 0, (2**31,), True),)), "integer array"),
        (StepPlan(0, chunks=(Chunk(1, -1, (1,), True),)), "cannot encode"),
        (StepPlan(-1), "cannot encode"),
        (StepPlan(0, new=(NewSequence(1, 0, SamplingParams(seed=2**600_000)),)), "cannot encode"),
        (StepPlan(0, removed=(2**63,)), "integer array"),
    ],
)
def test_unencodable_plans_raise_protocol_error(plan, message):
    with pytest.raises(ProtocolError, match=message):
        encode_plan(plan)


@pytest.mark.parametrize(
    "decode, data",
    [
        (decode_hello, encode_hello(Hello(1, 2, "f")) + b"!"),
        (decode_hello, encode_hello(Hello(1, 2, "f"))[:-1]),
        (decode_ack, encode_ack(Ack(1, 2))[:5]),
        (decode_welcome, b""),
        (decode_reason, b"\x05\x00\x00\x00ab"),
    ],
)
def test_malformed_small_messages(decode, data):
    with pytest.raises(ProtocolError):
        decode(data)
