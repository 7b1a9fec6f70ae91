"""The disaggregated-prefill protocol against hostile or confused peers, the received-block tier, and
the scheduler's block exports."""

from __future__ import annotations

import socket
import struct
import threading
import time

import mlx.core as mx
import msgspec
import numpy as np
import pytest

from meshlm.config import SchedulerConfig
from meshlm.disagg import prefill_wire as pw
from meshlm.engine.request import SamplingParams, Sequence
from meshlm.engine.scheduler import Scheduler
from meshlm.kv.blocks import BlockManager
from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.kv.received import HostBlock, ReceivedBlocks, ReceivedThenSSD
from meshlm.kv.store import BlockData
from meshlm.transport import stage_wire
from meshlm.transport.auth import ClusterSecret

INFO = pw.PeerInfo("abc", "float32", "tp1", 4, (0, 2), 2, 8, 100)


def pair() -> tuple[pw.Conn, pw.Conn]:
    """Both ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return pw.Conn(a, "a"), pw.Conn(b, "b")


def soon(seconds: float = 2.0) -> float:
    return time.monotonic() + seconds


def block(seed: int, dtype=mx.float32) -> BlockData:
    rng = np.random.default_rng(seed)
    layers = [mx.array(rng.standard_normal((2, 4, 8)).astype(np.float32)).astype(dtype) for _ in range(4)]
    return BlockData(layers[:2], layers[2:])


def test_peer_info_mismatch_names_every_difference():
    other = msgspec.structs.replace(INFO, fingerprint="xyz", kv_dtype="float16")
    why = INFO.mismatch(other)
    assert "model fingerprint xyz (this server: abc)" in why and "KV dtype float16 (this server: float32)" in why
    assert INFO.mismatch(INFO) is None


def test_messages_round_trip_and_strict_decoding():
    a, b = pair()
    job = pw.Job(7, [1, 2, 3, 4], 0)
    a.send_message(job, soon())
    assert b.recv_message(soon()) == job
    # An extra field, a wrong type, an unknown tag: refused, never half-read.
    for bad in ({"type": "job", "job_id": 1, "token_ids": [1], "first_block": 0, "extra": 1},
                {"type": "job", "job_id": "1", "token_ids": [1], "first_block": 0},
                {"type": "nope"}):
        raw = msgspec.msgpack.encode(bad)
        a.send(struct.pack("!I", len(raw)) + raw, soon())
        with pytest.raises(pw.PrefillWireError, match="invalid message"):
            b.recv_message(soon())
    a.send(struct.pack("!I", 1 << 30), soon())  # announces a gigabyte: refused before reading it
    with pytest.raises(pw.PrefillWireError, match="limit"):
        b.recv_message(soon(), max_bytes=1 << 16)


def test_silent_and_closed_peers_are_distinct_errors():
    a, b = pair()
    with pytest.raises(pw.WireTimeout):
        b.recv_message(time.monotonic() + 0.2)
    a.close()
    with pytest.raises(pw.WireClosed):
        b.recv_message(soon())


def _packet(job: int, index: int, data: BlockData) -> tuple[bytes, int]:
    return pw.block_packet(job, index, INFO.block_size, data)


def test_block_packet_round_trip_on_the_host():
    data = block(1)
    packet, crc = _packet(3, 5, data)
    a, b = pair()
    a.send(packet, soon())
    host = pw.read_block(b, INFO, mx.float32, 3, 5, crc, soon())
    assert isinstance(host.keys, np.ndarray) and host.keys.shape == (2, 1, 2, 4, 8)
    back = host.to_device()
    for x, y in zip(data.keys + data.values, back.keys + back.values):
        assert mx.array_equal(x, y)


def test_bfloat16_blocks_survive_the_host_tier():
    data = block(2, mx.bfloat16)
    packet, crc = pw.block_packet(1, 0, 4, data)
    a, b = pair()
    a.send(packet, soon())
    back = pw.read_block(b, INFO, mx.bfloat16, 1, 0, crc, soon()).to_device()
    assert back.keys[0].dtype == mx.bfloat16 and mx.array_equal(back.keys[1], data.keys[1])


@pytest.mark.parametrize("fault, match", [
    ("crc", "fails its CRC"),
    ("pos", "expected pos"),
    ("job", "expected step"),
    ("dtype", "expected dtype"),
    ("shape", "expected shape"),
    ("truncated", "closed"),
])
def test_bad_block_packets_are_refused(fault, match):
    data = block(3)
    job, index = 3, 5
    if fault == "dtype":
        data = BlockData([a.astype(mx.float16) for a in data.keys], [a.astype(mx.float16) for a in data.values])
    if fault == "shape":
        data = BlockData(data.keys[:1], data.values[:1])  # one layer where two are held
    packet, crc = _packet(job + (fault == "job"), index + (fault == "pos"), data)
    if fault == "crc":
        packet = packet[:-5] + bytes([packet[-5] ^ 1]) + packet[-4:]
    a, b = pair()
    a.send(packet[: len(packet) // 2] if fault == "truncated" else packet, soon())
    if fault == "truncated":
        a.close()
    with pytest.raises(pw.PrefillWireError, match=match):
        pw.read_block(b, INFO, mx.float32, job, index, crc, soon())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_blocks_are_refused_though_their_crc_matches(dtype, bad):
    # A peer holding the secret computed (or made) NaN KV: the CRC cannot tell, and one NaN poisons the cache.
    data = block(4, dtype)
    values = list(data.values)
    values[1] = mx.where(mx.arange(values[1].size).reshape(values[1].shape) == 17, mx.array(bad, dtype), values[1])
    packet, crc = _packet(3, 5, BlockData(data.keys, values))
    a, b = pair()
    a.send(packet, soon())
    with pytest.raises(pw.PrefillWireError, match="NaN or inf"):
        pw.read_block(b, INFO, dtype, 3, 5, crc, soon())
    packet, crc = _packet(3, 5, data)  # the same block, finite: accepted
    a.send(packet, soon())
    assert pw.read_block(b, INFO, dtype, 3, 5, crc, soon()).finite()


def test_a_huge_announced_tensor_is_refused_before_its_bytes():
    a, b = pair()
    head = stage_wire.HEADER.pack(stage_wire.VERSION, 0, 0, 1, 0)
    meta = struct.pack("!BiiQQQQQQ", 1, 6, 5, 2, 1, 2, 4, 8, 2**40)  # float32, 5-D, 1 TiB payload
    a.send(head + meta, soon())
    with pytest.raises(pw.PrefillWireError, match="bad KV packet"):
        pw.read_block(b, INFO, mx.float32, 1, 0, 0, soon())


def test_handshake_needs_the_same_secret():
    secret, other = ClusterSecret("a" * 64), ClusterSecret("b" * 64)
    server = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{server.getsockname()[1]}"
    errors = []

    def accept_one(key):
        sock, peer = server.accept()
        try:
            pw.accept(sock, "x", key, 2).close()
        except pw.PrefillWireError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=accept_one, args=(secret,))
    t.start()
    pw.connect(addr, secret, 2).close()
    t.join()
    assert not errors
    t = threading.Thread(target=accept_one, args=(other,))
    t.start()
    with pytest.raises(pw.PrefillWireError, match="did not prove"):
        pw.connect(addr, secret, 2)
    t.join()
    with pytest.raises(pw.Unreachable):
        server.close()
        pw.connect(addr, secret, 1)


def test_received_tier_is_bounded_and_found_by_the_block_manager():
    host = HostBlock(np.zeros((2, 1, 2, 4, 8), np.float32), np.zeros((2, 1, 2, 4, 8), np.float32), mx.float32)
    tier = ReceivedBlocks(max_bytes=2 * host.nbytes)
    for key in (b"k1", b"k2", b"k3"):
        tier.put(key, host, 1)
    assert b"k3" not in tier and len(tier) == 2 and tier.dropped == 1  # a chain keeps its start
    salt = CacheSalt("m", "float32", "tp1", 4)
    tokens = list(range(12))
    keys = block_keys(tokens, salt)
    tier.put(keys[0], host, 2)  # another transfer: the first one's last block makes room, then its first
    tier.put(keys[1], host, 2)
    assert len(tier) == 2 and tier.dropped == 3
    blocks = BlockManager(16, 4, salt, ReceivedThenSSD(tier))
    assert blocks.cached_prefix(keys) == 2
    m = blocks.match(0, tokens + [99])
    assert m.tokens == 8 and [k for k, _ in m.loads] == keys[:2]
    assert tier.load(keys[0]) is not None and tier.load(keys[0]) is None  # a load takes it out


def test_a_full_tier_keeps_whole_prefixes_of_interleaved_transfers():
    """Regression: concurrent jobs' blocks arrive interleaved; least-recently-received eviction dropped every
    prompt's first blocks, so none of what stayed could be found (each prompt was prefilled again)."""
    host = HostBlock(np.zeros((2, 1, 2, 4, 8), np.float32), np.zeros((2, 1, 2, 4, 8), np.float32), mx.float32)
    tier = ReceivedBlocks(max_bytes=10 * host.nbytes)
    salt = CacheSalt("m", "float32", "tp1", 4)
    prompts = [list(range(100 * p, 100 * p + 24)) for p in range(3)]  # 6 blocks each, 18 for room for 10
    chains = [block_keys(tokens, salt) for tokens in prompts]
    for i in range(6):
        for job, keys in enumerate(chains, 1):
            tier.put(keys[i], host, job)
    blocks = BlockManager(64, 4, salt, ReceivedThenSSD(tier))
    found = [blocks.cached_prefix(keys) for keys in chains]
    assert sum(found) == len(tier) == 10 and tier.dropped == 8  # every block kept is found
    assert found[0] == 6  # the first to fill the tier is kept whole
    cut = found.index(min(found))
    for key in chains[0]:
        tier.load(key)  # room again
    tier.put(chains[cut][found[cut] + 1], host, cut + 1)  # after its gap: refused
    assert chains[cut][found[cut] + 1] not in tier
    tier.end(cut + 1)  # that transfer ended: its id is free again
    tier.put(chains[cut][found[cut]], host, cut + 1)
    assert blocks.cached_prefix(chains[cut]) == found[cut] + 1


def test_blocks_a_plan_will_load_outlive_transfers_meanwhile():
    # The block manager's prefetch said yes, the plan holds the keys; before the runner reads them, another
    # transfer's blocks arrive into a full tier and an aborted one discards its own. Either used to take the
    # plan's blocks away: BlockMissing, a failed engine step, every running request ended.
    host = HostBlock(np.zeros((2, 1, 2, 4, 8), np.float32), np.zeros((2, 1, 2, 4, 8), np.float32), mx.float32)
    tier = ReceivedBlocks(max_bytes=3 * host.nbytes)
    salt = CacheSalt("m", "float32", "tp1", 4)
    tokens = list(range(8))
    keys = block_keys(tokens, salt)
    for key in keys:
        tier.put(key, host, 1)
    m = BlockManager(16, 4, salt, ReceivedThenSSD(tier)).match(0, tokens + [99])
    assert [k for k, _ in m.loads] == keys
    for job, key in enumerate((b"x1", b"x2", b"x3"), 2):
        tier.put(key, host, job)  # room for one more: x1 goes in, x2 displaces x1, x3 displaces x2
    tier.put(keys[0], host, 5)  # a transfer sending a planned block again keeps it set aside
    tier.discard(keys[1:])
    assert all(tier.load(key) is not None for key in keys)  # what runner._read does
    assert b"x3" in tier and len(tier) == 1 and tier.dropped == 2
    # Set aside blocks a plan never loaded (a failed step) become evictable again once the engine resets.
    tier.put(b"x4", host, 6)
    tier.put(b"x5", host, 7)
    ReceivedThenSSD(tier).prefetch(b"x4")
    tier.unpin_all()
    for key in (b"y1", b"y2", b"y3"):
        tier.put(key, host, 8)
    assert b"x4" not in tier and len(tier) == 3


def test_scheduler_exports_every_prompt_block_once_final():
    bs = 4
    blocks = BlockManager(64, bs, CacheSalt("m", "float32", "tp1", bs))
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_tokens_per_step=8), blocks, 128)
    seq = Sequence(0, list(range(20)), SamplingParams(max_tokens=1), export_from=1)
    sched.add(seq)
    exported, table = [], []
    for _ in range(6):
        table = list(blocks.table(0)) if 0 in blocks else table  # the plan that exports the last block frees them
        plan, _ = sched.schedule()
        exported += [x.index for x in plan.exports]
        assert all(x.block == table[x.index] for x in plan.exports)
        for c in plan.chunks:
            assert all(x.index < c.start // bs for x in plan.exports if x.uid == c.uid)  # only final blocks
        sched.update(plan, {c.uid: [5] for c in plan.chunks if c.sample})
        if seq.finished and not plan.exports and not sched.running:
            break
    assert exported == [1, 2, 3, 4]  # from first_block on, each once, the last one after the last chunk


class _SlowEngine:
    """A prefill server's engine whose job waits `delay` s in its queue, then exports every block."""

    def __init__(self, delay: float) -> None:
        self.delay, self.aborted = delay, threading.Event()

    def submit(self, token_ids, params, emit, export):
        from meshlm.engine.request import FinishReason, StepOutput

        def later() -> None:
            if self.aborted.wait(self.delay):
                return
            for i in range(export.first_block, len(token_ids) // INFO.block_size):
                export.sink(i, block(i))
            emit(StepOutput(0, finish_reason=FinishReason.LENGTH))

        threading.Thread(target=later, daemon=True).start()
        return 0

    def abort(self, uid: int) -> None:
        self.aborted.set()


def _service(engine, timeout: float = 30.0):
    from meshlm.disagg.prefill_server import PrefillService
    from meshlm.metrics import Metrics

    salt = CacheSalt("f" * 24, "float32", "tp1", INFO.block_size)
    return PrefillService(engine, INFO, salt, ClusterSecret("0" * 64), "127.0.0.1", 0, timeout, Metrics()), salt


def test_a_queued_job_says_it_is_waiting_until_its_blocks_come():
    """Regression: a job waiting in a busy prefill server's queue sent nothing, and its decode server took
    the silence past --prefill-timeout for a dead peer and prefilled the prompt itself. Now Waiting comes
    every WAITING_SECONDS until the blocks do."""
    service, salt = _service(_SlowEngine(delay=2.5))
    job = pw.Job(3, list(range(12)), 1)
    a, b = pair()
    threading.Thread(target=service._run, args=(b, job, block_keys(job.token_ids, salt)), daemon=True).start()
    got = []
    while not got or not isinstance(got[-1], pw.Done):
        msg = a.recv_message(time.monotonic() + 2 * pw.WAITING_SECONDS)  # never silent for longer
        if isinstance(msg, pw.Block):
            pw.read_block(a, INFO, mx.float32, job.job_id, msg.index, msg.crc, soon())
        got.append(msg)
    kinds = [type(m).__name__ for m in got]
    assert kinds[:2] == ["Waiting", "Waiting"] and kinds[-3:] == ["Block", "Block", "Done"], kinds
    service.close()


def test_a_queued_job_whose_client_left_is_aborted():
    """The Waiting it sends finds the connection closed: the job stops instead of computing for no one."""
    engine = _SlowEngine(delay=30)
    service, salt = _service(engine)
    a, b = pair()
    job = pw.Job(4, list(range(12)), 0)

    def run() -> None:
        with pytest.raises(pw.WireClosed):  # after the abort, as the connection's handler expects
            service._run(b, job, block_keys(job.token_ids, salt))

    threading.Thread(target=run, daemon=True).start()
    a.close()
    assert engine.aborted.wait(4 * pw.WAITING_SECONDS)
    service.close()


def test_strangers_hold_handshake_places_not_job_slots(monkeypatch):
    """Regression: a connection that never authenticates held one of the 64 job slots for the whole
    handshake deadline. Now it holds a handshake place, at most MAX_HANDSHAKES_PER_HOST per address (more
    are dropped at once), and a job's slot is taken only once its peer proved the secret."""
    from meshlm.disagg import prefill_server

    monkeypatch.setattr(prefill_server, "MAX_CONNECTIONS", 1)
    service, _ = _service(_SlowEngine(delay=0.1))
    service.start()
    addr = f"127.0.0.1:{service.port}"
    silent = [socket.create_connection(("127.0.0.1", service.port)) for _ in range(prefill_server.MAX_HANDSHAKES_PER_HOST)]
    try:
        extra = socket.create_connection(("127.0.0.1", service.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # over the address's places: closed at once, nothing read
        extra.close()
        silent.pop().close()  # a place frees as its connection ends
        deadline = time.monotonic() + 5
        while True:  # the server notices the close within its read
            try:
                conn = pw.connect(addr, ClusterSecret("0" * 64), 5)  # the one job slot is still free
                break
            except pw.PrefillWireError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        conn.send_message(INFO, soon())
        assert isinstance(conn.recv_message(soon(), 1 << 16), pw.PeerInfo)
        conn.close()
    finally:
        for s in silent:
            s.close()
        service.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("form", ["[::1]:{}", "::1:{}"])
def test_a_prefill_server_on_ipv6_is_reached_by_either_form_of_its_address(form):
    """Before: the server bound IPv4 only (exit 2 on --host ::1), and a --prefill-peer of [::1]:P passed
    the check but could never connect (the brackets went to the resolver)."""
    from meshlm.disagg.prefill_server import PrefillService
    from meshlm.metrics import Metrics

    salt = CacheSalt("f" * 24, "float32", "tp1", INFO.block_size)
    service = PrefillService(_SlowEngine(delay=0), INFO, salt, ClusterSecret("0" * 64), "::1", 0, 30.0, Metrics())
    service.start()
    try:
        conn = pw.connect(form.format(service.port), ClusterSecret("0" * 64), 5)
        conn.send_message(INFO, soon())
        assert isinstance(conn.recv_message(soon(), 1 << 16), pw.PeerInfo)
        conn.close()
    finally:
        service.close()

