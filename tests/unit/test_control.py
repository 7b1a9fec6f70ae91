"""Control channel over real sockets on 127.0.0.1: lockstep plans, heartbeats, deadlines, failures."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from meshlm.engine.plan import Chunk, NewSequence, StepPlan
from meshlm.engine.request import SamplingParams
from meshlm.parallel.codec import (
    Ack,
    FrameDecoder,
    Hello,
    Kind,
    Welcome,
    encode_ack,
    encode_frame,
    encode_hello,
    encode_plan,
    encode_welcome,
)
from meshlm.parallel.control import (
    ControlLeader,
    ControlWorker,
    HandshakeError,
    LeaderLost,
    ProtocolError,
    SplitBrain,
    WorkerFailed,
    WorkerLost,
)

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 5.0
FP = "model@rev1"
REPO = Path(__file__).resolve().parents[2]


def plan(step_id: int, tokens: tuple[int, ...] = (1, 2, 3), fingerprint: int = 0) -> StepPlan:
    return StepPlan(step_id, chunks=(Chunk(1, 0, tokens, sample=True),), fingerprint=fingerprint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerThread(threading.Thread):
    """The standard worker loop; records plans received and the error that ended it, if any."""

    def __init__(self, port: int, rank: int, world_size: int, fingerprint: str = FP, *,
                 on_plan: Callable[[ControlWorker, StepPlan], None] | None = None, **kw: float) -> None:
        super().__init__(daemon=True)
        kw.setdefault("timeout", TIMEOUT)
        self.worker = ControlWorker("127.0.0.1", port, rank, fingerprint, world_size=world_size, **kw)
        self.on_plan = on_plan or (lambda w, p: w.ack(p.step_id, p.fingerprint))
        self.plans: list[StepPlan] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.worker.connect()
            while (p := self.worker.next_plan()) is not None:
                self.plans.append(p)
                self.on_plan(self.worker, p)
        except BaseException as e:  # recorded for the test to assert on
            self.error = e
        finally:
            self.worker.close()


@contextmanager
def cluster(world_size: int = 3, leader_kw: dict | None = None, **worker_kw: object
            ) -> Iterator[tuple[ControlLeader, list[WorkerThread]]]:
    leader = ControlLeader("127.0.0.1", 0, world_size, TIMEOUT, fingerprint=FP, **(leader_kw or {}))
    workers = [WorkerThread(leader.port, r, world_size, **worker_kw) for r in range(1, world_size)]
    for w in workers:
        w.start()
    try:
        leader.wait_for_workers()
        yield leader, workers
    finally:
        leader.shutdown(linger=1.0)
        for w in workers:
            w.join(timeout=5)
            assert not w.is_alive()


# -- the happy path ------------------------------------------------------------------


def test_hundred_plans_in_order_with_acks():
    rng = random.Random(5)
    sent = [
        StepPlan(
            step_id=i,
            new=(NewSequence(i, 0, SamplingParams(seed=i, stop=("</s>",))),) if i % 10 == 0 else (),
            chunks=tuple(Chunk(u, i, tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 50))), True)
                         for u in range(3)),
            removed=(i - 1,) if i % 7 == 0 else (),
            fingerprint=rng.randrange(1, 2**64),
        )
        for i in range(100)
    ]
    with cluster(3) as (leader, workers):
        seqs = []
        for p in sent:
            seqs.append(leader.broadcast(p))
            acks = leader.collect_acks(p.step_id)
            assert acks == {1: Ack(p.step_id, p.fingerprint), 2: Ack(p.step_id, p.fingerprint)}
        assert seqs == list(range(1, 101))  # seq 0 was WELCOME
    for w in workers:
        assert w.error is None
        assert w.plans == sent
        assert w.worker.shutdown_reason == "leader shutting down"


def test_acks_may_be_collected_late_and_are_all_checked():
    with cluster(2) as (leader, _):
        for i in range(5):
            leader.broadcast(plan(i, fingerprint=100 + i))
        assert leader.collect_acks(4) == {1: Ack(4, 104)}  # steps 0..3 checked on the way
        with pytest.raises(ValueError, match="no outstanding acks"):
            leader.collect_acks(2)


def test_large_plan_with_200k_token_chunk():
    big = plan(0, tokens=tuple(i * 7919 % 150_000 for i in range(200_000)), fingerprint=9)
    with cluster(3) as (leader, workers):
        t0 = time.monotonic()
        leader.broadcast(big)
        assert set(leader.collect_acks(0)) == {1, 2}
        assert time.monotonic() - t0 < 2.0
    assert all(w.plans == [big] for w in workers)


def test_world_size_one_has_no_workers():
    leader = ControlLeader(world_size=1, timeout=1.0)
    assert leader.wait_for_workers() == {}
    leader.broadcast(plan(0))
    assert leader.collect_acks(0) == {}
    leader.shutdown()


# -- liveness --------------------------------------------------------------------------


def test_heartbeats_keep_an_idle_worker_alive_past_its_timeout():
    with cluster(2, leader_kw={"heartbeat_interval": 0.05}, timeout=0.3) as (leader, workers):
        end = time.monotonic() + 1.0  # > 3x the worker's timeout
        sent = 0
        while time.monotonic() < end:
            sent += leader.maybe_heartbeat()
            time.sleep(0.01)
        assert 10 <= sent <= 25
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0)) == {1}
    assert workers[0].error is None and len(workers[0].plans) == 1


def test_silent_leader_makes_worker_raise_leader_lost():
    leader = ControlLeader(world_size=2, timeout=TIMEOUT)
    worker = ControlWorker("127.0.0.1", leader.port, 1, FP, 0.3, world_size=2)
    t = threading.Thread(target=worker.connect, daemon=True)
    t.start()
    leader.wait_for_workers()
    t.join()
    t0 = time.monotonic()
    with pytest.raises(LeaderLost, match="not even a heartbeat"):
        worker.next_plan()
    assert 0.25 < time.monotonic() - t0 < 1.0
    worker.close()
    leader.close()


def test_closed_leader_is_noticed_at_once():
    leader = ControlLeader(world_size=2, timeout=TIMEOUT)
    with ControlWorker("127.0.0.1", leader.port, 1, FP, TIMEOUT, world_size=2) as worker:
        t = threading.Thread(target=worker.connect, daemon=True)
        t.start()
        leader.wait_for_workers()
        t.join()
        leader.close()
        t0 = time.monotonic()
        with pytest.raises(LeaderLost, match="closed"):
            worker.recv()
        assert time.monotonic() - t0 < 1.0


WORKER_SCRIPT = """
import sys
from meshlm.parallel.control import ControlWorker
port, rank = int(sys.argv[1]), int(sys.argv[2])
with ControlWorker("127.0.0.1", port, rank, "model@rev1", 10.0, world_size=3) as w:
    w.connect()
    while (plan := w.next_plan()) is not None:
        w.ack(plan.step_id, plan.fingerprint)
"""


@contextmanager
def worker_processes(port: int, ranks: list[int]) -> Iterator[dict[int, subprocess.Popen]]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {r: subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, str(port), str(r)], env=env) for r in ranks}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)


def test_sigkilled_worker_is_detected_during_a_step():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP)
    with worker_processes(leader.port, [1, 2]) as procs:
        leader.wait_for_workers(timeout=10)
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0)) == {1, 2}
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost) as info:
            leader.broadcast(plan(1))
            leader.collect_acks(1)
        assert info.value.rank == 2 and "rank 2" in str(info.value)
        assert time.monotonic() - t0 < 3.0
        leader.shutdown()
        assert procs[1].wait(timeout=5) == 0  # the survivor got SHUTDOWN and exited cleanly


def test_sigkilled_worker_is_detected_while_idle():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, heartbeat_interval=0.05)
    with worker_processes(leader.port, [1, 2]) as procs:
        leader.wait_for_workers(timeout=10)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost) as info:
            while time.monotonic() - t0 < 3.0:
                leader.maybe_heartbeat()
                time.sleep(0.01)
        assert info.value.rank == 1
        assert time.monotonic() - t0 < 3.0
        leader.shutdown()
        assert procs[2].wait(timeout=5) == 0


def test_worker_that_never_acks_is_lost_at_the_deadline():
    with cluster(3, on_plan=lambda w, p: w.ack(p.step_id, 0) if w.rank == 1 else None) as (leader, _):
        leader.broadcast(plan(0))
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match="no ACK for step 0") as info:
            leader.collect_acks(0, timeout=0.3)
        assert info.value.rank == 2
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(WorkerLost, match="already lost"):
            leader.heartbeat()


def test_split_brain_names_the_rank():
    wrong = lambda w, p: w.ack(p.step_id, p.fingerprint + (w.rank == 2))  # noqa: E731
    with cluster(3, on_plan=wrong) as (leader, _):
        leader.broadcast(plan(0, fingerprint=41))
        with pytest.raises(SplitBrain, match="rank 2") as info:
            leader.collect_acks(0)
        assert (info.value.rank, info.value.step_id, info.value.expected, info.value.actual) == (2, 0, 41, 42)


def test_worker_error_is_reported():
    with cluster(2, on_plan=lambda w, p: w.ack(p.step_id, 0, error="KeyError: uid 7")) as (leader, _):
        leader.broadcast(plan(3))
        with pytest.raises(WorkerFailed, match="rank 1 failed step 3: KeyError: uid 7"):
            leader.collect_acks(3)


# -- handshake -------------------------------------------------------------------------


def _start(port: int, world_size: int, specs: list[tuple[int, str]], **kw: object) -> list[WorkerThread]:
    workers = [WorkerThread(port, r, world_size, fp, **kw) for r, fp in specs]
    for w in workers:
        w.start()
    return workers


def _join(workers: list[WorkerThread]) -> None:
    for w in workers:
        w.join(timeout=5)
        assert not w.is_alive()


def test_fingerprint_mismatch_is_rejected_on_both_sides():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP)
    workers = _start(leader.port, 3, [(1, FP), (2, "model@rev2")], connect_timeout=1.0)
    message = "rank 2 loaded model fingerprint 'model@rev2' but the leader's is 'model@rev1'"
    with pytest.raises(HandshakeError, match=message):
        leader.wait_for_workers()
    _join(workers)
    assert isinstance(workers[1].error, HandshakeError)
    assert "leader rejected rank 2" in str(workers[1].error) and "same model revision" in str(workers[1].error)
    assert isinstance(workers[0].error, HandshakeError)  # rejected too, or refused: the cluster never forms


def test_workers_must_agree_with_each_other_without_a_leader_fingerprint():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT)
    workers = _start(leader.port, 3, [(1, "a")])
    time.sleep(0.2)  # rank 1 first, so the message is deterministic
    workers += _start(leader.port, 3, [(2, "b")])
    with pytest.raises(HandshakeError, match="rank 2 loaded model fingerprint 'b' but rank 1's is 'a'"):
        leader.wait_for_workers()
    _join(workers)


def test_missing_rank_is_named_at_the_deadline():
    leader = ControlLeader(world_size=4, timeout=TIMEOUT, fingerprint=FP)
    workers = _start(leader.port, 4, [(2, FP)])
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=r"missing ranks \[1, 3\]"):
        leader.wait_for_workers(timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    _join(workers)
    assert "missing ranks [1, 3]" in str(workers[0].error)


@pytest.mark.parametrize(
    "specs, world, message",
    [
        ([(1, FP), (1, FP)], 3, "two workers claim rank 1"),
        ([(1, FP)], 2, "world size 3, the leader with 2"),
    ],
)
def test_bad_rank_layouts_are_rejected(specs, world, message):
    leader = ControlLeader(world_size=world, timeout=TIMEOUT, fingerprint=FP)
    workers = _start(leader.port, 3, specs, connect_timeout=1.0)
    with pytest.raises(HandshakeError, match=message):
        leader.wait_for_workers()
    _join(workers)


def test_stray_connections_do_not_disturb_the_handshake():
    leader = ControlLeader(world_size=2, timeout=TIMEOUT, fingerprint=FP)
    silent = socket.create_connection(("127.0.0.1", leader.port))
    http = socket.create_connection(("127.0.0.1", leader.port))
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 40)
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(leader.wait_for_workers()) == {1}
    leader.shutdown()
    _join(workers)
    assert workers[0].error is None
    silent.close()
    http.close()


def test_worker_retries_until_the_leader_binds():
    port = free_port()
    workers = _start(port, 2, [(1, FP)])
    time.sleep(0.3)
    leader = ControlLeader("127.0.0.1", port, 2, TIMEOUT, fingerprint=FP)
    leader.wait_for_workers()
    leader.broadcast(plan(0))
    assert set(leader.collect_acks(0)) == {1}
    leader.shutdown()
    _join(workers)
    assert workers[0].error is None


def test_unreachable_leader_fails_at_the_connect_deadline():
    worker = ControlWorker("127.0.0.1", free_port(), 1, FP, TIMEOUT, world_size=2, connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="could not reach the leader"):
        worker.connect()
    assert time.monotonic() - t0 < 1.0


# -- hostile or broken peers -------------------------------------------------------------


def _read_frame(sock: socket.socket) -> None:
    dec = FrameDecoder()
    while dec.next_frame() is None:
        dec.feed(sock.recv(65536))


@contextmanager
def fake_leader(frames: list[bytes]) -> Iterator[int]:
    """Accepts one worker, reads its HELLO, sends WELCOME (seq 0), then `frames` verbatim."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def run() -> None:
        conn, _ = server.accept()
        with conn:
            _read_frame(conn)
            conn.sendall(encode_frame(Kind.WELCOME, 0, encode_welcome(Welcome(2, FP))) + b"".join(frames))
            done.wait(5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        t.join(5)
        server.close()


def _corrupt(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0x40])


GOOD_PLAN = encode_plan(plan(0))


@pytest.mark.parametrize(
    "frames, message",
    [
        ([_corrupt(encode_frame(Kind.PLAN, 1, GOOD_PLAN))], "checksum mismatch"),
        ([encode_frame(Kind.PLAN, 2, GOOD_PLAN)], "sequence 2 .* expected 1: gap"),
        ([encode_frame(Kind.PLAN, 0, GOOD_PLAN)], "sequence 0 .* expected 1: duplicate"),
        ([encode_frame(Kind.HEARTBEAT, 1), encode_frame(Kind.HEARTBEAT, 1)], "duplicate"),
        ([encode_frame(Kind.ACK, 1, encode_ack(Ack(0, 0)))], "unexpected ACK"),
        ([b"MLCP\x09\x00" + encode_frame(Kind.PLAN, 1, GOOD_PLAN)[6:]], "protocol version 9"),
        ([encode_frame(Kind.PLAN, 1, GOOD_PLAN[:-1])], "truncated PLAN payload"),
        ([encode_frame(Kind.HEARTBEAT, 1, b"x")], "trailing garbage in HEARTBEAT"),
    ],
)
def test_worker_refuses_bad_frames_from_the_leader(frames, message):
    with fake_leader(frames) as port, ControlWorker("127.0.0.1", port, 1, FP, 2.0, world_size=2) as worker:
        worker.connect()
        with pytest.raises(ProtocolError, match=message):
            worker.next_plan()


@contextmanager
def fake_worker(leader: ControlLeader) -> Iterator[socket.socket]:
    """A raw socket that says HELLO as rank 1 and reads WELCOME; the test writes what it likes."""
    sock = socket.create_connection(("127.0.0.1", leader.port))
    sock.sendall(encode_frame(Kind.HELLO, 0, encode_hello(Hello(1, 2, FP))))
    leader.wait_for_workers()
    _read_frame(sock)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize(
    "ack_frame, message",
    [
        (_corrupt(encode_frame(Kind.ACK, 1, encode_ack(Ack(0, 0)))), "rank 1: checksum mismatch"),
        (encode_frame(Kind.ACK, 5, encode_ack(Ack(0, 0))), "rank 1: sequence 5"),
        (encode_frame(Kind.ACK, 1, encode_ack(Ack(7, 0))), "rank 1 acked step 7, expected step 0"),
        (encode_frame(Kind.HELLO, 1, encode_hello(Hello(1, 2, FP))), "rank 1 sent HELLO after the handshake"),
        (encode_frame(Kind.PLAN, 1, GOOD_PLAN), "rank 1: unexpected PLAN frame"),
    ],
)
def test_leader_refuses_bad_frames_from_a_worker(ack_frame, message):
    leader = ControlLeader(world_size=2, timeout=2.0, fingerprint=FP)
    with fake_worker(leader) as sock:
        leader.broadcast(plan(0))
        sock.sendall(ack_frame)
        with pytest.raises(ProtocolError, match=message):
            leader.collect_acks(0)
    leader.close()
