"""The disaggregated-prefill protocol: a decode server asks a prefill server for a prompt's KV blocks.

One job per TCP connection, the decode server connecting (docs/DISAGGREGATED.md):
1. handshake (integers big-endian): connecting -> accepting b"MLPF", u32 version, 32-byte nonce;
   accepting -> connecting: 32-byte nonce, 32-byte proof; connecting -> accepting: 32-byte proof
   (auth.prefill_proof over both nonces: only holders of the cluster secret take part);
2. each side sends `PeerInfo` (what its KV means and looks like) and checks the other's: a peer with
   another model, KV dtype, block size, layout or layer range is refused before any job is sent;
3. decode -> prefill: `Job` (the prompt's whole blocks, and the first block it lacks);
4. prefill -> decode, per block in order: `Block` (its index and key), then its KV as a stage-wire KV
   packet (transport/stage_wire.py) with step = job id, pos = first position of the block, and
   k, v of shape [layers, 1, kv_heads, block_size, head_dim]; then `Done`, or `Failed` at any point.

Messages are length-prefixed (u32, big-endian) msgpack of the structs below, decoded strictly (a
missing or extra field, a wrong type, an unknown tag is an error). Every size is checked against
what the receiver expects before it reads the bytes.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from typing import Union

import mlx.core as mx
import msgspec

from meshlm.config import split_addr
from meshlm.kv.received import HostBlock
from meshlm.kv.store import BlockData
from meshlm.transport import stage_wire
from meshlm.transport.auth import ClusterSecret, new_nonce, prefill_proof, proof_matches
from meshlm.transport.link import recv_exactly, send_all, tune

MAGIC = b"MLPF"
VERSION = 2  # 2: Waiting
MAX_MESSAGE_BYTES = 16 << 20  # a Job of 1M token ids is ~5 MiB of msgpack
# A prefill server drops connections from an address that already has this many still authenticating
# (one stranger cannot hold every slot); a decode server keeps its own handshakes to a peer below it.
MAX_HANDSHAKES_PER_HOST = 4
_HELLO = struct.Struct("!4sI32s")
_LEN = struct.Struct("!I")
NONCE = PROOF = 32


class PrefillWireError(Exception):
    """The peer is unreachable, refused, or sent something that is not what was expected."""


class WireTimeout(PrefillWireError):
    """The peer sent (or read) nothing within the deadline."""


class WireClosed(PrefillWireError):
    """The connection closed or failed."""


class Unreachable(PrefillWireError):
    """No connection could be made."""


class PeerInfo(msgspec.Struct, tag="info", forbid_unknown_fields=True, frozen=True):
    """What one server's KV blocks mean and look like; two servers exchange blocks only if these match."""

    fingerprint: str
    kv_dtype: str
    layout: str
    block_size: int
    layers: tuple[int, int]  # [first, end) of the model's layers this rank holds
    kv_heads: int
    head_dim: int
    vocab_size: int

    def mismatch(self, other: "PeerInfo") -> str | None:
        """Why blocks of `other` cannot be restored here (None when they can)."""
        names = {"fingerprint": "model fingerprint", "kv_dtype": "KV dtype", "layout": "parallel layout",
                 "block_size": "block size", "layers": "layer range", "kv_heads": "KV heads",
                 "head_dim": "head dim", "vocab_size": "vocabulary size"}
        diff = [f"{name} {getattr(other, f)} (this server: {getattr(self, f)})"
                for f, name in names.items() if getattr(self, f) != getattr(other, f)]
        return "; ".join(diff) or None


class Job(msgspec.Struct, tag="job", forbid_unknown_fields=True, frozen=True):
    job_id: int
    token_ids: list[int]  # whole blocks of the prompt, from its start
    first_block: int  # blocks before this one the decode server holds already: they are not sent


class Block(msgspec.Struct, tag="block", forbid_unknown_fields=True, frozen=True):
    index: int
    key: bytes  # the block's prefix-cache key (kv/keys.py): the receiver checks it against its own
    crc: int  # CRC-32 of the whole KV packet that follows: a flipped bit is refused, never restored


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True, frozen=True):
    blocks: int  # blocks sent


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True, frozen=True):
    reason: str


class Waiting(msgspec.Struct, tag="waiting", forbid_unknown_fields=True, frozen=True):
    """The job is queued or computing, with no block ready: sent every WAITING_SECONDS meanwhile, so that a
    busy prefill server is not taken for a silent one (its queued jobs had timed out and been prefilled
    again by the decode server), and so that it learns at once when its client has gone."""


WAITING_SECONDS = 1.0
Message = Union[PeerInfo, Job, Block, Done, Failed, Waiting]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class Conn:
    """One socket with deadline-bounded reads and writes; every failure is a PrefillWireError."""

    def __init__(self, sock: socket.socket, peer: str, liveness: float = 10.0) -> None:
        self.sock = sock
        self.peer = peer
        tune(sock, liveness)

    def send(self, data: bytes, deadline: float) -> None:
        try:
            send_all(self.sock, data, deadline)
        except TimeoutError:
            raise WireTimeout(f"{self.peer}: send timed out (peer not reading)") from None
        except OSError as exc:
            raise WireClosed(f"{self.peer}: connection failed: {exc}") from None

    def recv_exactly(self, n: int, deadline: float) -> bytes:
        try:
            return recv_exactly(self.sock, n, deadline)
        except TimeoutError:
            raise WireTimeout(f"{self.peer}: nothing received in time") from None
        except EOFError:
            raise WireClosed(f"{self.peer}: connection closed") from None
        except OSError as exc:
            raise WireClosed(f"{self.peer}: connection failed: {exc}") from None

    def send_message(self, message: Message, deadline: float) -> None:
        payload = _ENCODER.encode(message)
        if len(payload) > MAX_MESSAGE_BYTES:
            raise PrefillWireError(f"a {type(message).__name__} of {len(payload)} bytes is over the message limit")
        self.send(_LEN.pack(len(payload)) + payload, deadline)

    def recv_message(self, deadline: float, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
        (n,) = _LEN.unpack(self.recv_exactly(_LEN.size, deadline))
        if n > max_bytes:
            raise PrefillWireError(f"{self.peer}: announces a {n}-byte message, the limit here is {max_bytes}")
        try:
            return _DECODER.decode(self.recv_exactly(n, deadline))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PrefillWireError(f"{self.peer}: invalid message: {exc}") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(addr: str, secret: ClusterSecret, timeout: float, on_socket=None) -> Conn:
    """Connect to a prefill server at host:port and prove the cluster secret both ways. `on_socket(conn)`:
    called once connected, before the handshake (whoever may cancel takes the connection then)."""
    host, port = split_addr(addr)
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except (OSError, ValueError) as exc:
        raise Unreachable(f"{addr}: unreachable: {exc}") from None
    conn = Conn(sock, addr)
    if on_socket is not None:
        on_socket(conn)
    try:
        nonce = new_nonce()
        conn.send(_HELLO.pack(MAGIC, VERSION, nonce), deadline)
        reply = conn.recv_exactly(NONCE + PROOF, deadline)
        theirs, proof = reply[:NONCE], reply[NONCE:]
        if not proof_matches(prefill_proof(secret, True, theirs, nonce), proof):
            raise PrefillWireError(f"{addr}: did not prove it holds the cluster secret")
        conn.send(prefill_proof(secret, False, nonce, theirs), deadline)
    except BaseException:
        conn.close()
        raise
    return conn


def accept(sock: socket.socket, peer: str, secret: ClusterSecret, timeout: float) -> Conn:
    """The accepting end of the handshake; a stranger, another build or a wrong secret is a PrefillWireError."""
    deadline = time.monotonic() + timeout
    conn = Conn(sock, peer)
    magic, version, theirs = _HELLO.unpack(conn.recv_exactly(_HELLO.size, deadline))
    if magic != MAGIC:
        raise PrefillWireError(f"{peer}: not a meshlm prefill client")
    if version != VERSION:
        raise PrefillWireError(f"{peer}: speaks prefill protocol version {version}, this build speaks {VERSION}")
    nonce = new_nonce()
    conn.send(nonce + prefill_proof(secret, True, nonce, theirs), deadline)
    if not proof_matches(prefill_proof(secret, False, theirs, nonce), conn.recv_exactly(PROOF, deadline)):
        raise PrefillWireError(f"{peer}: did not prove it holds the cluster secret")
    return conn


# -- KV blocks as stage-wire packets ------------------------------------------------------------------


def block_packet(job_id: int, index: int, block_size: int, data: BlockData) -> tuple[bytes, int]:
    """A block's KV (per layer (kv_heads, block_size, head_dim)) as one KV packet, and its CRC.
    Evaluates MLX arrays: call it on the thread that runs the model."""
    k, v = mx.stack(data.keys)[:, None], mx.stack(data.values)[:, None]
    packet = stage_wire.encode_kv(0, 0, job_id, index * block_size, k, v)
    return packet, zlib.crc32(packet)


def read_block(conn: Conn, info: PeerInfo, dtype: mx.Dtype, job_id: int, index: int, crc: int,
               deadline: float) -> HostBlock:
    """The KV packet of block `index`, checked against this server's own shape, dtype, the job and `crc`,
    and for values that are all finite (host memory only: this runs on a transfer thread)."""
    layers = info.layers[1] - info.layers[0]
    shape = (layers, 1, info.kv_heads, info.block_size, info.head_dim)
    expect = stage_wire.Expect(stage_from=0, stage_to=0, step=job_id, pos=index * info.block_size,
                               tensors=(stage_wire.TensorExpect(dtype, shape),) * 2,
                               max_bytes=2 * layers * info.kv_heads * info.block_size * info.head_dim * dtype.size)
    seen = 0

    def recv(n: int) -> bytes:
        nonlocal seen
        data = conn.recv_exactly(n, deadline)
        seen = zlib.crc32(data, seen)
        return data

    try:
        _, (k, v) = stage_wire.read_packet(recv, expect, host=True)
    except stage_wire.StageWireError as exc:
        raise PrefillWireError(f"{conn.peer}: bad KV packet for block {index}: {exc}") from None
    if seen != crc:
        raise PrefillWireError(f"{conn.peer}: KV packet for block {index} fails its CRC (corrupted)")
    block = HostBlock(k, v, dtype)
    if not block.finite():  # the CRC matched: the peer computed (or made) it so; it must never reach the cache
        raise PrefillWireError(f"{conn.peer}: KV packet for block {index} holds NaN or inf")
    return block
