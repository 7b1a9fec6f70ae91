"""Control-plane codec: frames, and messages derived from their dataclasses; exact round trips, and
every malformed input is a ProtocolError."""

from __future__ import annotations

import dataclasses
import random
import struct

import msgspec
import pytest

from meshlm.engine.plan import (LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, BlockCopy, BlockLoad, BlockSave, Chunk,
                                NewSequence, StepPlan, TableUpdate, Trim)
from meshlm.transport import codec
from meshlm.transport.codec import (HEADER_SIZE, MESSAGE_TYPES, VERSION, Ack, Challenge, Frame, FrameDecoder, Hello, Kind, Loaded,
                                    Proof, ProtocolError, VersionMismatch, Welcome, decode, decode_frame,
                                    decode_reason, encode, encode_frame, encode_reason, encode_reject, welcome_fields)

I64 = (-(2**63), 2**63 - 1)
TEXTS = ["", "stop", "\n\n", "ünïcødé ✓", "🙂", "lone \ud800 surrogate", "a\x00b"]


# -- messages (hypothesis is not installed: seeded random instead) -----------------------------------


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choice([rng.randrange(0, 50_000), rng.randint(0, 2**31 - 1)]) for _ in range(n))


def random_plan(rng: random.Random) -> StepPlan:
    uids = [rng.randint(*I64) for _ in range(rng.randrange(0, 5))]
    blocks = lambda: tuple(rng.randrange(0, 10**6) for _ in range(rng.randrange(0, 6)))  # noqa: E731
    return StepPlan(
        step_id=rng.randrange(0, 2**64),
        new=tuple(NewSequence(u, rng.randrange(0, 10**6), rng.randrange(-1, 4)) for u in uids[:2]),
        chunks=tuple(Chunk(u, rng.randrange(0, 2**40), random_ids(rng, rng.randrange(1, 300)),
                           rng.choice([LOGITS_NONE, LOGITS_LAST, LOGITS_ALL])) for u in uids),
        removed=tuple(rng.randint(*I64) for _ in range(rng.randrange(0, 4))),
        tables=tuple(TableUpdate(u, blocks()) for u in uids),
        trims=tuple(Trim(u, rng.randrange(0, 999), rng.randrange(0, 99)) for u in uids[:1]),
        copies=tuple(BlockCopy(rng.randrange(99), rng.randrange(99), rng.randrange(33)) for _ in range(rng.randrange(3))),
        loads=tuple(BlockLoad(rng.randbytes(16), rng.randrange(99)) for _ in range(rng.randrange(3))),
        saves=tuple(BlockSave(rng.randrange(99), rng.randbytes(16)) for _ in range(rng.randrange(3))),
        num_blocks=rng.randrange(0, 2**32),
        fingerprint=rng.randrange(0, 2**64),
    )


def test_random_plans_round_trip_exactly():
    rng = random.Random(1)
    for _ in range(300):
        plan = random_plan(rng)
        assert decode(Kind.PLAN, encode(plan)) == plan


def test_every_plan_field_is_on_the_wire():
    """Derived from the dataclass: a field added to StepPlan travels without codec changes."""
    plan = random_plan(random.Random(5))
    wire = msgspec.msgpack.decode(encode(plan))
    assert set(wire) == {f.name for f in dataclasses.fields(StepPlan)}


def test_other_messages_round_trip():
    for msg in (Hello(rank=3, world_size=4, nonce=bytes(range(32))),
                Welcome(world_size=4, mac=b"\xff" * 32), Challenge(b"n" * 32), Proof(b"m" * 32),
                Loaded(fingerprint="sha256:abc/ünï", kv_blocks=2**40),
                Ack(step_id=2**64 - 1, fingerprint=12345, error="KeyError: uid 3"),
                Ack(step_id=3, fingerprint=1, times=(0.5,), missing=(b"k" * 16, b"\0" * 16))):
        kind = next(k for k, t in MESSAGE_TYPES.items() if t is type(msg))
        assert decode(kind, encode(msg)) == msg
    assert decode_reason(encode_reason("bye \ud800")) == "bye \ud800"
    assert welcome_fields(4) != welcome_fields(5)


PLAN = encode(StepPlan(4, new=(NewSequence(9, 2),), chunks=(Chunk(9, 2, (3, 4), LOGITS_LAST),), removed=(1,),
                       tables=(TableUpdate(9, (0, 1)),), num_blocks=2, fingerprint=77))


def test_every_truncation_of_a_plan_is_a_protocol_error():
    for n in range(len(PLAN)):
        with pytest.raises(ProtocolError, match="invalid PLAN payload"):
            decode(Kind.PLAN, PLAN[:n])


def test_trailing_bytes_in_a_plan_are_refused():
    with pytest.raises(ProtocolError, match="invalid PLAN payload"):
        decode(Kind.PLAN, PLAN + b"\x00")


def test_random_plan_mutations_only_ever_raise_protocol_error():
    rng = random.Random(7)
    for _ in range(3000):
        b = bytearray(PLAN)
        for _ in range(rng.randrange(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            decode(Kind.PLAN, bytes(b))
        except ProtocolError:
            pass


@pytest.mark.parametrize("wire, words", [
    ({"step_id": "one"}, "Expected `int`"),  # wrong type
    ({"chunks": [{"uid": 1, "start": 0, "token_ids": [1.5], "logits": 1}]}, "Expected `int`"),
    ({"chunks": [{"uid": 1, "token_ids": [1]}]}, "missing required field"),
    ({"loads": [{"key": "not bytes", "block": 0}]}, "Expected `bytes`"),
    ({"new": 5}, "Expected `array`"),
])
def test_plans_of_the_wrong_shape_are_protocol_errors(wire, words):
    with pytest.raises(ProtocolError, match=words):
        decode(Kind.PLAN, msgspec.msgpack.encode({"step_id": 0, **wire}))


@pytest.mark.parametrize("plan", [
    StepPlan(0, chunks=(Chunk(1, 0, (2**70,), LOGITS_LAST),)),  # no integer beyond 64 bits crosses
    StepPlan(0, removed=(-(2**64),)),
])
def test_unencodable_plans_raise_protocol_error(plan):
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(plan)


@pytest.mark.parametrize("kind, data", [
    (Kind.HELLO, encode(Hello(1, 2, b"n" * 32)) + b"!"),
    (Kind.HELLO, encode(Hello(1, 2, b"n" * 32))[:-1]),
    (Kind.WELCOME, welcome_fields(2)),  # no mac
    (Kind.LOADED, encode(Loaded("f", 3))[:-1]),
    (Kind.LOADED, msgspec.msgpack.encode({"fingerprint": 7, "kv_blocks": 3})),  # a field of the wrong type
    (Kind.ACK, encode(Ack(1, 2))[:5]),
    (Kind.ACK, msgspec.msgpack.encode({"step_id": 1, "fingerprint": 2, "missing": [b"short"]})),  # not a key
    (Kind.ACK, msgspec.msgpack.encode({"step_id": 1, "fingerprint": 2, "missing": ["k" * 16]})),
    (Kind.WELCOME, b""),
    (Kind.HEARTBEAT, b""),  # carries no message
])
def test_malformed_small_messages(kind, data):
    with pytest.raises(ProtocolError):
        decode(kind, data)


def test_malformed_reasons():
    for data in (b"\x05\x00\x00\x00ab", b"\x01\x00", b"\x01\x00\x00\x00\xff"):
        with pytest.raises(ProtocolError):
            decode_reason(data)


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


GOOD = encode_frame(Kind.PLAN, 7, encode(StepPlan(3, chunks=(Chunk(1, 0, (1, 2, 3), LOGITS_LAST),))))

MALFORMED_FRAMES = {
    "empty": (b"", "truncated frame header"),
    "short header": (GOOD[:HEADER_SIZE - 1], "truncated frame header"),
    "bad magic": (b"HTTP" + GOOD[4:], "bad magic"),
    "wrong version": (_patched(GOOD, 4, "<H", 99), "protocol version 99"),
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


# -- versions and the handshake's fixed-size fields --------------------------------------------


def test_another_version_is_a_version_mismatch_naming_both():
    with pytest.raises(VersionMismatch, match=f"protocol version 99, this build speaks {codec.VERSION}") as info:
        decode_frame(_patched(GOOD, 4, "<H", 99))
    assert info.value.version == 99


@pytest.mark.parametrize("version", [1, codec.VERSION + 1, 0xFFFF])
def test_a_reject_of_any_version_is_read(version):
    """REJECT's layout is frozen, so two builds that disagree can still say why to each other."""
    data = encode_reject(3, "wrong build", version)
    assert struct.unpack_from("<4sHB", data) == (b"MLCP", version, Kind.REJECT)
    frame = decode_frame(data)
    assert (frame.kind, frame.seq, frame.version) == (Kind.REJECT, 3, version)
    assert decode_reason(frame.payload) == "wrong build"
    dec = FrameDecoder()
    dec.feed(data)
    assert dec.next_frame() == frame


def test_an_unreadable_reject_of_another_version_still_names_the_version():
    data = encode_reject(0, "why", VERSION + 1)
    with pytest.raises(VersionMismatch, match=f"protocol version {VERSION + 1}"):
        decode_frame(data[:-1] + bytes([data[-1] ^ 1]))


def test_nonces_and_macs_must_have_their_exact_size():
    for bad in (b"", b"x" * 31, b"x" * 33):
        for make in (lambda b: Challenge(b), lambda b: Hello(1, 2, b), lambda b: Welcome(2, b),
                     lambda b: Proof(b)):
            with pytest.raises(ValueError, match="must be 32 bytes"):
                make(bad)
        # ...and a peer's payload with one of another size is refused on decoding.
        forged = msgspec.msgpack.encode({"rank": 1, "world_size": 2, "nonce": bad})
        with pytest.raises(ProtocolError, match="32 bytes"):
            decode(Kind.HELLO, forged)


def test_proofs_never_appear_in_a_repr():
    assert "m" * 8 not in repr(Welcome(2, b"m" * 32))
    assert "n" * 8 not in repr(Hello(1, 2, b"n" * 32))
