"""Control channel over real sockets on 127.0.0.1: the authenticated handshake, lockstep plans, heartbeats,
deadlines, failures, strangers and peers of another protocol version."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan
from meshlm.transport import codec, control
from meshlm.transport.auth import SECRET_ENV, ClusterSecret, hello_proof, welcome_proof
from meshlm.transport.codec import (
    HEADER_SIZE,
    Ack,
    Challenge,
    Frame,
    FrameDecoder,
    Hello,
    Kind,
    Proof,
    TokenIds,
    Welcome,
    decode,
    decode_reason,
    encode,
    encode_frame,
    welcome_fields,
)
from meshlm.step_times import PHASES
from meshlm.transport.control import (
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
SECRET_TEXT = "0123456789abcdef" * 4
SECRET = ClusterSecret(SECRET_TEXT)
OTHER_TEXT = "fedcba9876543210" * 4
OTHER = ClusterSecret(OTHER_TEXT)
REPO = Path(__file__).resolve().parents[2]


def plan(step_id: int, tokens: tuple[int, ...] = (1, 2, 3), fingerprint: int = 0) -> StepPlan:
    return StepPlan(step_id, chunks=(Chunk(1, 0, tokens, LOGITS_LAST),), fingerprint=fingerprint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerThread(threading.Thread):
    """The standard worker loop; records plans received and the error that ended it, if any."""

    def __init__(self, port: int, rank: int, world_size: int, fingerprint: str = FP, *,
                 on_plan: Callable[[ControlWorker, StepPlan], None] | None = None,
                 secret: ClusterSecret = SECRET, beat: float = 0.0, **kw: float) -> None:
        super().__init__(daemon=True)
        self.beat = beat  # > 0: heartbeat this often once started (ControlWorker.beat)
        kw.setdefault("timeout", TIMEOUT)
        self.worker = ControlWorker("127.0.0.1", port, rank, world_size=world_size, secret=secret, **kw)
        self.fingerprint = fingerprint
        self.on_plan = on_plan or (lambda w, p: w.ack(p.step_id, p.fingerprint))
        self.plans: list[StepPlan] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.worker.connect()
            self.worker.start(self.fingerprint)
            if self.beat:
                self.worker.beat(self.beat)
            while (p := self.worker.next_plan()) is not None:
                self.plans.append(p)
                self.on_plan(self.worker, p)
        except BaseException as e:  # recorded for the test to assert on
            self.error = e
        finally:
            self.worker.close()


def form(leader: ControlLeader, timeout: float | None = None, gone: Callable[[], str | None] | None = None) -> dict:
    """Both rounds of the start: the roll call, then every rank's LOADED and START."""
    leader.wait_for_workers(timeout, gone=gone)
    return leader.start(timeout, gone=gone)


@contextmanager
def cluster(world_size: int = 3, leader_kw: dict | None = None, **worker_kw: object
            ) -> Iterator[tuple[ControlLeader, list[WorkerThread]]]:
    leader = ControlLeader("127.0.0.1", 0, world_size, TIMEOUT, fingerprint=FP, secret=SECRET, **(leader_kw or {}))
    workers = [WorkerThread(leader.port, r, world_size, **worker_kw) for r in range(1, world_size)]
    for w in workers:
        w.start()
    try:
        form(leader)
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
            new=(NewSequence(i, 0),) if i % 10 == 0 else (),
            chunks=tuple(Chunk(u, i, tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 50))), LOGITS_LAST)
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
        assert seqs == list(range(3, 103))  # seq 0 was CHALLENGE, seq 1 WELCOME, seq 2 START
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


def test_a_plans_ids_may_follow_it_in_a_tokens_frame():
    """A pipeline's step planned ahead: the PLAN has placeholder ids and `ids_follow`; the TOKENS frame after
    it carries the real ones, and heartbeats in between are skipped."""
    got: list[tuple[int, ...]] = []

    def on_plan(worker: ControlWorker, p: StepPlan) -> None:
        if p.ids_follow:
            got.append(worker.next_ids(p))
        worker.ack(p.step_id, p.fingerprint)

    ahead = StepPlan(1, chunks=(Chunk(1, 3, (0,), LOGITS_LAST), Chunk(2, 7, (0,), LOGITS_LAST)), ids_follow=True)
    with cluster(3, on_plan=on_plan) as (leader, workers):
        leader.broadcast(plan(0))
        leader.broadcast(ahead)
        with pytest.raises(ValueError, match="follow their own plan"):
            leader.send_ids(0, [5])
        leader.heartbeat()
        leader.send_ids(1, [11, 12])
        assert set(leader.collect_acks(1)) == {1, 2}
    for w in workers:
        assert w.error is None and w.plans == [plan(0), ahead]
    assert got == [(11, 12), (11, 12)]


def test_large_plan_with_200k_token_chunk():
    big = plan(0, tokens=tuple(i * 7919 % 150_000 for i in range(200_000)), fingerprint=9)
    with cluster(3) as (leader, workers):
        t0 = time.monotonic()
        leader.broadcast(big)
        assert set(leader.collect_acks(0)) == {1, 2}
        assert time.monotonic() - t0 < 2.0
    assert all(w.plans == [big] for w in workers)


def test_world_size_one_has_no_workers():
    leader = ControlLeader(world_size=1, timeout=1.0, secret=SECRET)
    assert form(leader) == {}
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
        # At most one per interval (rate-limited; the leader's pulse thread sends some of them too).
        assert sent <= 21
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0)) == {1}
    assert workers[0].error is None and len(workers[0].plans) == 1


def test_a_leader_busy_without_a_word_still_heartbeats():
    # Its engine thread in a long forward (or loading a draft model before serving) calls nothing here:
    # the workers gave up on a healthy leader after --worker-timeout (tensor and context parallelism).
    with cluster(2, leader_kw={"heartbeat_interval": 0.1}, timeout=0.4) as (leader, workers):
        time.sleep(1.5)
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0)) == {1}
    assert workers[0].error is None and len(workers[0].plans) == 1


def test_a_worker_that_leaves_says_why():
    # Before: 'connection closed by peer (...; process died or host unreachable)', whatever the worker knew.
    with cluster(2) as (leader, workers):
        workers[0].worker.leave("rank 1 got SIGTERM")
        workers[0].worker.close()
        deadline = time.monotonic() + 3
        with pytest.raises(WorkerLost, match="rank 1 lost: it left: rank 1 got SIGTERM"):
            while time.monotonic() < deadline:
                leader.check_workers()
                time.sleep(0.01)


def test_silent_leader_makes_worker_raise_leader_lost():
    leader = ControlLeader(world_size=2, timeout=TIMEOUT, secret=SECRET)
    worker = ControlWorker("127.0.0.1", leader.port, 1, 0.3, world_size=2, secret=SECRET)
    t = threading.Thread(target=lambda: (worker.connect(), worker.start(FP)), daemon=True)
    t.start()
    form(leader)
    t.join()
    t0 = time.monotonic()
    with pytest.raises(LeaderLost, match="not even a heartbeat"):
        worker.next_plan()
    assert 0.25 < time.monotonic() - t0 < 1.0
    worker.close()
    # A leader that was only stopped (SIGSTOP, a paused VM) learns, once resumed, that the worker gave up
    # on it: before, 'connection closed by peer (...; process died ...)', as if the worker had crashed.
    with pytest.raises(WorkerLost, match="rank 1 lost: it left: rank 1: nothing from the leader for 0.3 s"):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            leader.check_workers()
            time.sleep(0.01)
    leader.close()


def test_closed_leader_is_noticed_at_once():
    leader = ControlLeader(world_size=2, timeout=TIMEOUT, secret=SECRET)
    with ControlWorker("127.0.0.1", leader.port, 1, TIMEOUT, world_size=2, secret=SECRET) as worker:
        t = threading.Thread(target=lambda: (worker.connect(), worker.start(FP)), daemon=True)
        t.start()
        form(leader)
        t.join()
        leader.close()
        t0 = time.monotonic()
        with pytest.raises(LeaderLost, match="closed"):
            worker.recv()
        assert time.monotonic() - t0 < 1.0


WORKER_SCRIPT = """
import os, sys
from meshlm.transport import codec, control
from meshlm.transport.auth import ClusterSecret
from meshlm.transport.control import ControlWorker
port, rank, world, codec.VERSION = map(int, sys.argv[1:5])  # VERSION: pretend to be another meshlm build
beat = float(sys.argv[5])
secret = ClusterSecret(os.environ["MESHLM_CLUSTER_SECRET"])
with ControlWorker("127.0.0.1", port, rank, 10.0, world_size=world, secret=secret) as w:
    w.connect()
    w.start("model@rev1")
    if beat:
        w.beat(beat)
    while (plan := w.next_plan()) is not None:
        w.ack(plan.step_id, plan.fingerprint)
"""


def worker_process(port: int, rank: int, world: int = 3, version: int = codec.VERSION,
                   secret: str = SECRET_TEXT, beat: float = 0.0, **kw: object) -> subprocess.Popen:
    """A worker in its own process; its secret comes through the environment, as a real rank's does."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), SECRET_ENV: secret}
    args = [str(port), str(rank), str(world), str(version), str(beat)]
    return subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, *args], env=env, **kw)  # type: ignore[call-overload]


@contextmanager
def worker_processes(port: int, ranks: list[int], beat: float = 0.0) -> Iterator[dict[int, subprocess.Popen]]:
    procs = {r: worker_process(port, r, beat=beat) for r in ranks}
    try:
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)


@pytest.mark.parametrize("during", ["idle", "step"])
def test_a_stopped_worker_is_lost_at_its_silence_not_the_step_deadline(during):
    # SIGSTOP stands for a hung process or a host that stopped answering without closing anything:
    # only its missing heartbeats tell, long before a step's deadline (60 s by default) would.
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET, heartbeat_interval=0.1,
                           silence_timeout=1.0)
    with worker_processes(leader.port, [1, 2], beat=0.1) as procs:
        form(leader, timeout=10)
        time.sleep(1.2)  # past the silence timeout: the heartbeats keep both alive
        leader.check_workers()
        procs[2].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(WorkerLost, match="not even a heartbeat") as info:
                if during == "step":
                    leader.broadcast(plan(0))
                    leader.collect_acks(0, timeout=20)
                while time.monotonic() - t0 < 5:
                    leader.maybe_heartbeat()
                    time.sleep(0.05)
            assert info.value.rank == 2 and time.monotonic() - t0 < 2.5
        finally:
            procs[2].send_signal(signal.SIGCONT)
        leader.shutdown()
        assert procs[1].wait(timeout=5) == 0


def test_a_worker_in_a_long_step_is_not_silent():
    # Its heartbeats come from a thread of its own; an acked rank's are read too while the leader
    # waits for another's ack.
    def slow(w: ControlWorker, p: StepPlan) -> None:
        time.sleep(1.5 if w.rank == 2 else 0.0)
        w.ack(p.step_id, p.fingerprint)

    with cluster(3, leader_kw={"silence_timeout": 0.6}, on_plan=slow, beat=0.1) as (leader, _):
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0, timeout=10)) == {1, 2}
        leader.check_workers()


def test_a_worker_that_does_not_beat_is_lost_within_a_long_step():
    def slow(w: ControlWorker, p: StepPlan) -> None:
        time.sleep(2.0)
        w.ack(p.step_id, p.fingerprint)

    with cluster(2, leader_kw={"silence_timeout": 0.6}, on_plan=slow) as (leader, _):
        leader.broadcast(plan(0))
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match="not even a heartbeat") as info:
            leader.collect_acks(0, timeout=10)
        assert info.value.rank == 1 and time.monotonic() - t0 < 1.6


def test_sigkilled_worker_is_detected_during_a_step():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    with worker_processes(leader.port, [1, 2]) as procs:
        form(leader, timeout=10)
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
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, heartbeat_interval=0.05, secret=SECRET)
    with worker_processes(leader.port, [1, 2]) as procs:
        form(leader, timeout=10)
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


def test_a_loss_one_caller_saw_is_still_named_to_the_next():
    # The watchdog's probe often reads a dead worker's hang-up first; the engine's diagnosis of the
    # collective that failed with it asks next, and was told nothing (health lost the rank's name).
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    with worker_processes(leader.port, [1, 2]) as procs:
        form(leader, timeout=10)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=5)
        deadline = time.monotonic() + 3.0
        with pytest.raises(WorkerLost) as first:
            while time.monotonic() < deadline:
                leader.check_workers()
                time.sleep(0.01)
        for later in (leader.check_workers, leader.check_arrived_acks, leader.heartbeat):
            with pytest.raises(WorkerLost) as info:
                later()
            assert info.value is first.value and info.value.rank == 1
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
        with pytest.raises(WorkerLost, match="no ACK for step 0"):  # the first cause, again
            leader.heartbeat()


def test_split_brain_names_the_rank():
    wrong = lambda w, p: w.ack(p.step_id, p.fingerprint + (w.rank == 2))  # noqa: E731
    with cluster(3, on_plan=wrong) as (leader, _):
        leader.broadcast(plan(0, fingerprint=41))
        with pytest.raises(SplitBrain, match="rank 2") as info:
            leader.collect_acks(0)
        assert (info.value.rank, info.value.step_id, info.value.expected, info.value.actual) == (2, 0, 41, 42)


def test_a_split_brain_already_acked_is_named_without_waiting():
    """A leader stuck in a step's collective (the worker acked a step it skipped) diagnoses from the ACKs
    already in, before any deadline."""
    wrong = lambda w, p: w.ack(p.step_id, p.fingerprint + (w.rank == 1))  # noqa: E731
    with cluster(3, on_plan=wrong) as (leader, _):
        leader.broadcast(plan(0, fingerprint=41))
        deadline = time.monotonic() + 5
        with pytest.raises(SplitBrain, match="rank 1"):
            while time.monotonic() < deadline:
                leader.check_arrived_acks()  # nothing yet, or rank 2's good ACK: no error
                time.sleep(0.01)


def test_arrived_acks_that_agree_are_taken_without_an_error():
    times = tuple(float(i) for i in range(len(PHASES)))
    with cluster(2, on_plan=lambda w, p: w.ack(p.step_id, p.fingerprint, times=times)) as (leader, _):
        leader.broadcast(plan(0, fingerprint=7))
        deadline = time.monotonic() + 5
        while 1 not in leader.worker_times and time.monotonic() < deadline:
            leader.check_arrived_acks()
            time.sleep(0.01)
        assert leader.worker_times[1] == times


def test_worker_error_is_reported():
    with cluster(2, on_plan=lambda w, p: w.ack(p.step_id, 0, error="KeyError: uid 7")) as (leader, _):
        leader.broadcast(plan(3))
        with pytest.raises(WorkerFailed, match="rank 1 failed step 3: KeyError: uid 7"):
            leader.collect_acks(3)



def test_acks_carry_each_workers_time_by_phase():
    times = tuple(float(i) for i in range(len(PHASES)))
    with cluster(3, on_plan=lambda w, p: w.ack(p.step_id, 0, times=times)) as (leader, _):
        leader.broadcast(plan(0))
        leader.collect_acks(0)
        assert leader.worker_times == {1: times, 2: times}


@pytest.mark.parametrize("times, message", [
    ((1.0,), "1 phase times, expected"),
    ((float("nan"),) * len(PHASES), "not a finite number"),
    ((-1.0,) * len(PHASES), "not a finite number"),
])
def test_acks_with_impossible_times_are_a_protocol_error(times, message):
    with cluster(2, on_plan=lambda w, p: w.ack(p.step_id, 0, times=times)) as (leader, _):
        leader.broadcast(plan(0))
        with pytest.raises(ProtocolError, match=f"rank 1 acked step 0 with .*{message}"):
            leader.collect_acks(0)


def test_acks_carry_each_workers_shared_memory_sums():
    """Only rank 0's sums were reported, so a worker's waits at them (the ranks' skew) were unseen."""
    with cluster(3, on_plan=lambda w, p: w.ack(p.step_id, 0, sums=(32, 0.5 * w.rank, 0.25))) as (leader, _):
        leader.broadcast(plan(0))
        leader.collect_acks(0)
        assert leader.worker_sums == {1: (32, 0.5, 0.25), 2: (32, 1.0, 0.25)}


@pytest.mark.parametrize("sums", [(1.0, 2.0), (1.0, float("nan"), 0.0), (1.0, -1.0, 0.0), (1.0, 1.0, 2.0)])
def test_acks_with_impossible_sums_are_a_protocol_error(sums):
    with cluster(2, on_plan=lambda w, p: w.ack(p.step_id, 0, sums=sums)) as (leader, _):
        leader.broadcast(plan(0))
        with pytest.raises(ProtocolError, match="rank 1 acked step 0 with sums"):
            leader.collect_acks(0)

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
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    workers = _start(leader.port, 3, [(1, FP), (2, "model@rev2")], connect_timeout=1.0)
    message = "rank 2 loaded model fingerprint 'model@rev2' but the leader's is 'model@rev1'"
    with pytest.raises(HandshakeError, match=message):
        form(leader)
    _join(workers)
    assert isinstance(workers[1].error, HandshakeError)
    assert "leader rejected rank 2" in str(workers[1].error) and "same model revision" in str(workers[1].error)
    assert isinstance(workers[0].error, HandshakeError)  # rejected too, or refused: the cluster never forms


def test_workers_must_agree_with_each_other_without_a_leader_fingerprint():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, secret=SECRET)
    workers = _start(leader.port, 3, [(1, "a"), (2, "b")])
    # Whichever worker finishes its handshake first sets the expectation; on a loaded
    # machine either order happens, so the message may name them either way round.
    either = (r"rank 2 loaded model fingerprint 'b' but rank 1's is 'a'"
              r"|rank 1 loaded model fingerprint 'a' but rank 2's is 'b'")
    with pytest.raises(HandshakeError, match=either):
        form(leader)
    _join(workers)


def test_missing_rank_is_named_at_the_deadline():
    leader = ControlLeader(world_size=4, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    workers = _start(leader.port, 4, [(2, FP)])
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=r"missing ranks \[1, 3\]"):
        form(leader, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    _join(workers)
    assert "missing ranks [1, 3]" in str(workers[0].error)


def test_the_roll_call_says_whom_it_still_waits_for_before_the_deadline(monkeypatch, caplog):
    """A hand-started rank that never comes was named only at the deadline (180 s by default)."""
    monkeypatch.setattr(control, "ROLL_CALL_REPORT_S", 0.2)
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    workers = _start(leader.port, 3, [(2, FP)])
    with caplog.at_level(logging.INFO, "meshlm.transport.control"), pytest.raises(HandshakeError):
        form(leader, timeout=0.7)
    _join(workers)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert 2 <= len(lines) <= 4, lines
    assert all(re.fullmatch(r"still waiting for workers on port \d+: missing ranks \[1\]; \d s left", x) for x in lines)


def test_a_rank_that_will_never_come_ends_the_wait_at_once():
    """A local worker that exited while loading: the wait ends within a poll, not at the 60 s deadline."""
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    workers = _start(leader.port, 3, [(1, FP)])
    t0 = time.monotonic()
    asked = []

    def gone():
        asked.append(time.monotonic())
        return "rank 2 exited with status -9 before joining the cluster" if time.monotonic() - t0 > 0.3 else None

    with pytest.raises(HandshakeError, match="rank 2 exited with status -9"):
        form(leader, timeout=60, gone=gone)
    assert time.monotonic() - t0 < 2 and len(asked) >= 2
    _join(workers)
    assert "rank 2 exited with status -9" in str(workers[0].error)  # the admitted rank is told why


@pytest.mark.parametrize(
    "specs, world, message",
    [
        ([(1, FP), (1, FP)], 3, "two workers claim rank 1"),
        ([(1, FP)], 2, "world size 3, the leader with 2"),
    ],
)
def test_bad_rank_layouts_are_rejected(specs, world, message):
    leader = ControlLeader(world_size=world, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    workers = _start(leader.port, 3, specs, connect_timeout=1.0)
    with pytest.raises(HandshakeError, match=message):
        form(leader)
    _join(workers)


LOADING_SCRIPT = """
import os, sys, time
from meshlm.transport.auth import ClusterSecret
from meshlm.transport.control import ControlWorker
port, rank, world = map(int, sys.argv[1:4])
w = ControlWorker("127.0.0.1", port, rank, 10.0, world_size=world, secret=ClusterSecret(os.environ["MESHLM_CLUSTER_SECRET"]))
w.connect()
time.sleep(60)  # loading its share, until killed
"""


def test_a_rank_that_dies_while_loading_ends_the_start_at_once_naming_it():
    """The roll call comes before the load and the connection stays open: a rank killed while loading is
    noticed by its closed socket, not at the start's deadline, and the other ranks are told why."""
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           SECRET_ENV: SECRET_TEXT}
    loading = subprocess.Popen([sys.executable, "-c", LOADING_SCRIPT, str(leader.port), "2", "3"], env=env)
    try:
        workers = _start(leader.port, 3, [(1, FP)])
        leader.wait_for_workers(timeout=10)
        loading.kill()
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=r"rank 2 hung up before it had loaded its share .*its own log"):
            leader.start(timeout=60)
        assert time.monotonic() - t0 < 2
    finally:
        loading.kill()
        loading.wait()
    _join(workers)
    assert "leader rejected rank 1: cluster start aborted: rank 2 hung up" in str(workers[0].error)


def test_the_start_names_the_ranks_still_loading_at_its_deadline():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    slow = ControlWorker("127.0.0.1", leader.port, 2, TIMEOUT, world_size=3, secret=SECRET)
    connecting = threading.Thread(target=slow.connect, daemon=True)
    connecting.start()
    workers = _start(leader.port, 3, [(1, FP)])
    leader.wait_for_workers()
    connecting.join()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=r"rank\(s\) 2 did not finish loading within 1 s of the leader"):
        leader.start(timeout=1.0)
    assert 0.9 < time.monotonic() - t0 < 2
    _join(workers)
    slow.close()


def test_the_start_returns_what_each_rank_loaded():
    leader = ControlLeader(world_size=3, timeout=TIMEOUT, fingerprint=FP, secret=SECRET)
    ranks = [ControlWorker("127.0.0.1", leader.port, r, TIMEOUT, world_size=3, secret=SECRET) for r in (1, 2)]
    threads = [threading.Thread(target=lambda w=w: (w.connect(), w.start(FP, kv_blocks=5 + w.rank)), daemon=True)
               for w in ranks]
    for t in threads:
        t.start()
    assert set(leader.wait_for_workers()) == {1, 2}
    assert leader.start() == {1: codec.Loaded(FP, 6), 2: codec.Loaded(FP, 7)}
    for t in threads:
        t.join(5)
    leader.broadcast(plan(0))
    for w in ranks:
        assert w.next_plan() == plan(0)
        w.ack(0, 0)
    assert set(leader.collect_acks(0)) == {1, 2}
    leader.shutdown(linger=0.5)
    for w in ranks:
        w.close()


def test_a_worker_stops_dialling_once_its_leader_is_gone():
    worker = ControlWorker("127.0.0.1", free_port(), 1, TIMEOUT, world_size=2, connect_timeout=30.0, secret=SECRET)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="rank 0 ended before the cluster formed"):
        worker.connect(gone=lambda: "rank 0 ended before the cluster formed" if time.monotonic() - t0 > 0.2 else None)
    assert time.monotonic() - t0 < 2


def test_worker_retries_until_the_leader_binds():
    port = free_port()
    workers = _start(port, 2, [(1, FP)])
    time.sleep(0.3)
    leader = ControlLeader("127.0.0.1", port, 2, TIMEOUT, fingerprint=FP, secret=SECRET)
    form(leader)
    leader.broadcast(plan(0))
    assert set(leader.collect_acks(0)) == {1}
    leader.shutdown()
    _join(workers)
    assert workers[0].error is None


def test_unreachable_leader_fails_at_the_connect_deadline():
    worker = ControlWorker("127.0.0.1", free_port(), 1, TIMEOUT, world_size=2, connect_timeout=0.3,
                           secret=SECRET)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="could not reach the leader"):
        worker.connect()
    assert time.monotonic() - t0 < 1.0


# -- raw peers: frames written by hand, for peers the real classes would never be ----------


class Raw:
    """One socket that speaks frames by hand (its decoder keeps what a recv brings beyond one frame)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dec = FrameDecoder()

    @classmethod
    def connect(cls, port: int) -> Raw:
        return cls(socket.create_connection(("127.0.0.1", port), timeout=5.0))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, timeout: float = 5.0) -> Frame:
        self.sock.settimeout(timeout)
        while (f := self.dec.next_frame()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("peer closed the connection")
            self.dec.feed(data)
        return f

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the peer hung up (frames still buffered are skipped)."""
        try:
            while True:
                self.frame(timeout)
        except (EOFError, ConnectionResetError):
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()


def _as_version(frame: bytes, version: int) -> bytes:
    """The same frame as another meshlm build would write it: the header's version and checksum redone."""
    b = bytearray(frame)
    b[4:6] = version.to_bytes(2, "little")
    digest = hashlib.blake2b(bytes(b[:20]), digest_size=8)
    digest.update(bytes(b[HEADER_SIZE:]))
    b[20:28] = digest.digest()
    return bytes(b)


def hello_frames(leader_nonce: bytes, secret: ClusterSecret, rank: int = 1, world: int = 2,
                 nonce: bytes = b"w" * 32) -> tuple[bytes, bytes]:
    """HELLO (seq 0) and PROOF (seq 1) as a worker holding `secret` writes them."""
    hello = encode(Hello(rank, world, nonce))
    proof = encode_frame(Kind.PROOF, 1, encode(Proof(hello_proof(secret, leader_nonce, hello))))
    return encode_frame(Kind.HELLO, 0, hello), proof


class Waiting(threading.Thread):
    """`form(leader)` in the background: the leader accepts only while it waits."""

    def __init__(self, leader: ControlLeader, timeout: float | None = None) -> None:
        super().__init__(daemon=True)
        self.leader, self.timeout = leader, timeout
        self.result: dict[int, Hello] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.leader.wait_for_workers(self.timeout)
        except BaseException as e:  # recorded for the test to assert on
            self.error = e

    def outcome(self, timeout: float = 10.0) -> dict[int, Hello]:
        self.join(timeout)
        assert not self.is_alive(), "the leader is still waiting"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _leader(world: int = 2, **kw: object) -> ControlLeader:
    kw.setdefault("timeout", TIMEOUT)
    return ControlLeader("127.0.0.1", 0, world, fingerprint=FP, secret=SECRET, **kw)  # type: ignore[arg-type]


def _serve_one_plan(leader: ControlLeader, workers: list[WorkerThread]) -> None:
    leader.start()
    leader.broadcast(plan(0))
    assert set(leader.collect_acks(0)) == {w.worker.rank for w in workers}
    leader.shutdown()
    _join(workers)
    assert all(w.error is None and len(w.plans) == 1 for w in workers)


# -- authentication ------------------------------------------------------------------------


def test_handshake_proves_both_sides_with_fresh_nonces():
    leader = _leader()
    waiting = Waiting(leader)
    raw = Raw.connect(leader.port)
    challenge = raw.frame()
    assert (challenge.kind, challenge.seq) == (Kind.CHALLENGE, 0)
    nonce = decode(Kind.CHALLENGE, challenge.payload).nonce
    for frame in hello_frames(nonce, SECRET):
        raw.send(frame)
    assert waiting.outcome() == {1: Hello(1, 2, b"w" * 32)}
    welcome = raw.frame()
    assert (welcome.kind, welcome.seq) == (Kind.WELCOME, 1)
    got = decode(Kind.WELCOME, welcome.payload)
    assert got.world_size == 2
    # The leader's proof covers this worker's nonce and its own: only a holder of the secret could write it.
    assert got.mac == welcome_proof(SECRET, b"w" * 32, nonce, welcome_fields(2))
    assert got.mac != welcome_proof(OTHER, b"w" * 32, nonce, welcome_fields(2))
    leader.close()
    raw.close()
    # Every connection gets a fresh challenge, so a recorded HELLO and PROOF cannot be replayed.
    again = _leader()
    waiting = Waiting(again, timeout=1.0)
    raws = [Raw.connect(again.port) for _ in range(2)]
    nonces = {decode(Kind.CHALLENGE, r.frame().payload).nonce for r in raws}
    assert len(nonces | {nonce}) == 3
    with pytest.raises(HandshakeError):
        waiting.outcome()
    for r in raws:
        r.close()


def test_replayed_proof_is_refused():
    leader = _leader(auth_timeout=2.0)
    waiting = Waiting(leader, timeout=1.5)
    first, second = Raw.connect(leader.port), Raw.connect(leader.port)
    recorded = hello_frames(decode(Kind.CHALLENGE, first.frame().payload).nonce, SECRET)
    second.frame()
    for frame in recorded:  # a PROOF made for the first connection's challenge, sent on the second
        second.send(frame)
    assert second.frame().kind is Kind.REJECT
    with pytest.raises(HandshakeError, match="missing ranks \\[1\\]; refused 1 connection"):
        waiting.outcome()
    first.close()
    second.close()


def test_wrong_secret_is_refused_at_once_and_the_real_rank_still_joins(caplog):
    leader = _leader()
    waiting = Waiting(leader)
    t0 = time.monotonic()
    impostors = _start(leader.port, 2, [(1, FP)], secret=OTHER, connect_timeout=TIMEOUT)
    _join(impostors)
    assert time.monotonic() - t0 < 2.0  # told at once, not left to its own deadline
    error = impostors[0].error
    assert isinstance(error, HandshakeError)
    assert "leader rejected rank 1: authentication failed" in str(error) and "secret" in str(error)
    assert waiting.is_alive()  # the leader did not give up: it still waits for the real rank 1
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, workers)
    assert re.search(r"dropped connection from 127\.0\.0\.1:\d+ during the handshake: authentication failed",
                     caplog.text)
    assert SECRET_TEXT not in caplog.text and OTHER_TEXT not in caplog.text


def test_wrong_secret_alone_fails_at_the_deadline_naming_the_refused_peer():
    leader = _leader()
    impostors = _start(leader.port, 2, [(1, FP)], secret=OTHER, connect_timeout=TIMEOUT)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError) as info:
        form(leader, timeout=1.0)
    assert 0.9 < time.monotonic() - t0 < 2.0
    message = str(info.value)
    assert re.search(r"missing ranks \[1\]; refused 1 connection\(s\): 127\.0\.0\.1:\d+: authentication failed",
                     message)
    assert SECRET_TEXT not in message and OTHER_TEXT not in message
    _join(impostors)


def test_strangers_sending_garbage_or_nothing_do_not_disturb_the_handshake():
    leader = _leader()
    waiting = Waiting(leader)
    strangers = [Raw.connect(leader.port) for _ in range(7)]
    silent, http, noise, quitter, forger, wrong_world, huge = strangers
    http.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 40)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the leader may hang up mid-frame
        huge.send(encode_frame(Kind.HELLO, 0, b"x" * (1 << 20)))  # refused at its header, never buffered
    noise.send(bytes(random.Random(3).randrange(256) for _ in range(500)))
    quitter.send(hello_frames(b"x" * 32, SECRET)[0])  # HELLO, then gone before its PROOF
    quitter.close()
    # Claims are not believed before the proof: a forged rank 1 is dropped, not "two workers claim rank 1".
    for frame in hello_frames(decode(Kind.CHALLENGE, forger.frame().payload).nonce, OTHER):
        forger.send(frame)
    for frame in hello_frames(decode(Kind.CHALLENGE, wrong_world.frame().payload).nonce, OTHER, world=99):
        wrong_world.send(frame)
    time.sleep(0.2)
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, workers)
    for raw in (http, noise, forger, wrong_world, huge):
        assert raw.closed_by_peer()
    for raw in strangers:
        raw.close()


def test_connections_still_in_their_handshake_are_told_why_once_the_cluster_forms(caplog):
    """A real worker can prove itself before a stranger that connected earlier: the stranger is then
    refused with a reason (its wrong proof judged if it sent one), never a bare reset, and logged as
    every refused connection is."""
    leader = _leader()
    waiting = Waiting(leader)
    pending, late_impostor = Raw.connect(leader.port), Raw.connect(leader.port)
    assert pending.frame().kind is Kind.CHALLENGE
    nonce = decode(Kind.CHALLENGE, late_impostor.frame().payload).nonce
    workers = _start(leader.port, 2, [(1, FP)])
    try:
        for frame in hello_frames(nonce, OTHER):
            late_impostor.send(frame)  # while the leader may already be welcoming rank 1
    except (BrokenPipeError, ConnectionResetError):
        pass  # it already refused and closed this connection: its REJECT is still there to read (below)
    assert set(waiting.outcome()) == {1}
    reasons = []
    for raw in (pending, late_impostor):
        frame = raw.frame()
        assert frame.kind is Kind.REJECT
        reasons.append(decode_reason(frame.payload))
    assert "stopped admitting workers" in reasons[0]
    assert "authentication failed" in reasons[1] or "stopped admitting workers" in reasons[1]
    assert len(re.findall(r"dropped connection from 127\.0\.0\.1:\d+ during the handshake", caplog.text)) == 2
    _serve_one_plan(leader, workers)
    pending.close()
    late_impostor.close()


def test_a_strangers_reject_is_dropped_not_believed():
    """A REJECT needs no secret: before, one from any connection ended the leader's start with the
    sender's text, blaming a rank ("rank 1 loaded model fingerprint 'x'...")."""
    leader = _leader()
    waiting = Waiting(leader)
    liar = Raw.connect(leader.port)
    assert liar.frame().kind is Kind.CHALLENGE
    liar.send(codec.encode_reject(0, "rank 1 loaded model fingerprint 'x' but the leader's is 'y'\nmore"))
    assert liar.closed_by_peer()
    assert waiting.is_alive()
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, workers)
    liar.close()


def test_silent_stranger_is_dropped_at_its_own_deadline():
    leader = _leader(auth_timeout=0.3)
    waiting = Waiting(leader, timeout=3.0)
    silent = Raw.connect(leader.port)
    assert silent.frame().kind is Kind.CHALLENGE
    t0 = time.monotonic()
    reject = silent.frame()
    assert reject.kind is Kind.REJECT and "no HELLO and PROOF within 0.3 s" in decode_reason(reject.payload)
    assert 0.2 < time.monotonic() - t0 < 1.5
    assert waiting.is_alive()
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, workers)
    silent.close()


def test_a_flood_of_strangers_is_bounded_and_the_real_rank_still_joins():
    leader = _leader(timeout=20.0)
    waiting = Waiting(leader)
    flood = [Raw.connect(leader.port) for _ in range(50)]  # more than the 32 held at once
    time.sleep(0.3)
    workers = _start(leader.port, 2, [(1, FP)])
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, workers)
    assert sum(raw.closed_by_peer(timeout=1.0) for raw in flood) == len(flood)  # none left open
    for raw in flood:
        raw.close()


def test_listener_is_closed_once_the_cluster_formed():
    with cluster(2) as (leader, _):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", leader.port), timeout=1.0)
        leader.broadcast(plan(0))
        assert set(leader.collect_acks(0)) == {1}


@contextmanager
def fake_leader(script: Callable[[Raw], None]) -> Iterator[int]:
    """Accepts one worker and runs `script` on the raw connection; yields the port."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def run() -> None:
        conn, _ = server.accept()
        raw = Raw(conn)
        try:
            script(raw)
            done.wait(5)
        finally:
            raw.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        t.join(5)
        server.close()


def leader_handshake(raw: Raw, secret: ClusterSecret = SECRET, nonce: bytes = b"l" * 32) -> None:
    """What a leader holding `secret` does with one worker: CHALLENGE, read HELLO and PROOF, WELCOME."""
    raw.send(encode_frame(Kind.CHALLENGE, 0, encode(Challenge(nonce))))
    hello = decode(Kind.HELLO, raw.frame().payload)
    assert raw.frame().kind is Kind.PROOF
    mac = welcome_proof(secret, hello.nonce, nonce, welcome_fields(2))
    raw.send(encode_frame(Kind.WELCOME, 1, encode(Welcome(2, mac))))


def test_worker_refuses_a_leader_without_the_secret():
    def impostor(raw: Raw) -> None:
        leader_handshake(raw, OTHER)
        raw.send(encode_frame(Kind.PLAN, 2, GOOD_PLAN))  # must never be applied

    with fake_leader(impostor) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                      secret=SECRET) as worker:
        with pytest.raises(HandshakeError, match="did not prove it holds the cluster secret"):
            worker.connect()
        with pytest.raises(LeaderLost, match="not connected"):
            worker.next_plan()


def test_worker_refuses_a_welcome_without_a_challenge():
    def eager(raw: Raw) -> None:
        raw.frame()
        raw.send(encode_frame(Kind.WELCOME, 0, encode(Welcome(2, b"\0" * 32))))

    with fake_leader(eager) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                   secret=SECRET) as worker:
        with pytest.raises(ProtocolError, match="expected CHALLENGE or REJECT, got WELCOME"):
            worker.connect()


# -- peers of another protocol version ---------------------------------------------------------


def test_worker_of_another_version_fails_at_once_and_the_leaders_deadline_names_it():
    """The worker of another build fails at once; the leader, which cannot tell it from a stranger's frame (an
    unproven one must not end its start), names it when its own deadline passes."""
    leader = _leader(timeout=10.0)
    proc = worker_process(leader.port, 1, world=2, version=codec.VERSION + 1, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=rf"127\.0\.0\.1:\d+: speaks control protocol version "
                                                 rf"{codec.VERSION + 1}, this leader speaks {codec.VERSION}"):
            form(leader, timeout=4.0)
        _, err = proc.communicate(timeout=5)
        assert time.monotonic() - t0 < 6.0
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    assert (f"speaks control protocol version {codec.VERSION}, this build speaks {codec.VERSION + 1}" in err
            or f"version {codec.VERSION + 1}, this leader speaks {codec.VERSION}" in err), err


def _old_build_hello(port: int) -> bytes:
    """What a version-1 build's worker hears after its HELLO: everything until the leader hangs up."""
    old = Raw.connect(port)
    old.send(_as_version(encode_frame(Kind.HELLO, 0, b"an old build's HELLO"), 1))
    received = b""
    while chunk := old.sock.recv(65536):
        received += chunk
    old.close()
    return received


def test_reject_to_an_older_build_is_written_in_its_version_and_the_start_goes_on():
    """A rank of another build hears why in its own version at once. Unproven, the frame ends that connection
    only: 28 bytes from anyone on the network ended the cluster's start (helper-61); the real worker still
    joins, and a start that times out names the version."""
    leader = _leader(timeout=10.0)
    waiting = Waiting(leader)
    t0 = time.monotonic()
    received = _old_build_hello(leader.port)
    assert time.monotonic() - t0 < 2.0
    reject_at = HEADER_SIZE + struct.unpack_from("<I", received, 16)[0]  # after the CHALLENGE
    assert received[6] == Kind.CHALLENGE and received[reject_at + 6] == Kind.REJECT
    assert int.from_bytes(received[reject_at + 4:reject_at + 6], "little") == 1  # a version 1 build reads this
    reject = codec.decode_frame(received[reject_at:])
    assert (reject.kind, reject.version) == (Kind.REJECT, 1)
    assert "version 1" in decode_reason(reject.payload)
    worker = WorkerThread(leader.port, 1, 2)
    worker.start()
    assert set(waiting.outcome()) == {1}
    _serve_one_plan(leader, [worker])
    leader.close()

    alone = _leader(timeout=10.0)
    waiting = Waiting(alone, timeout=1.5)
    _old_build_hello(alone.port)
    with pytest.raises(HandshakeError, match="missing ranks \\[1\\].*speaks control protocol version 1, this leader"):
        waiting.outcome()
    alone.close()


def test_leader_of_another_version_is_refused_at_once():
    heard: list[Frame] = []

    def newer(raw: Raw) -> None:
        raw.send(_as_version(encode_frame(Kind.CHALLENGE, 0, encode(Challenge(b"n" * 32))), codec.VERSION + 1))
        heard.append(raw.frame())  # HELLO, sent before the worker read anything
        heard.append(raw.frame())  # the worker's REJECT, written in this leader's version

    with fake_leader(newer) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                   connect_timeout=10.0, secret=SECRET) as worker:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=f"speaks control protocol version {codec.VERSION + 1}, "
                                                 f"this build speaks {codec.VERSION}"):
            worker.connect()
        assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + 5
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert heard[0].kind is Kind.HELLO
    assert (heard[1].kind, heard[1].version) == (Kind.REJECT, codec.VERSION + 1)
    assert "all ranks must run the same meshlm version" in decode_reason(heard[1].payload)


def test_reject_from_an_older_leader_is_read_and_explained():
    def old(raw: Raw) -> None:
        raw.frame()
        raw.send(_as_version(codec.encode_reject(0, "protocol version 2, this build speaks 1"), 1))

    with fake_leader(old) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                 secret=SECRET) as worker:
        with pytest.raises(HandshakeError, match=r"\(control protocol version 1, this build speaks "
                                                 rf"{codec.VERSION}\) rejected rank 1: protocol version 2"):
            worker.connect()


def test_a_process_on_the_control_port_that_has_not_proved_itself_is_held_to_little():
    """Before WELCOME a 'leader' is anyone on the port: a 64 MiB frame was buffered whole (+130 MB), and a
    REJECT's reason went into the log uncut, forged lines included (helper-61)."""
    def huge(raw: Raw) -> None:
        raw.frame()  # the HELLO
        header = bytearray(codec.encode_frame(Kind.CHALLENGE, 0, encode(Challenge(b"n" * 32))))
        struct.pack_into("<I", header, 16, 64 << 20)  # announces 64 MiB
        raw.send(bytes(header[:HEADER_SIZE]) + b"x" * (1 << 20))

    with fake_leader(huge) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2, secret=SECRET,
                                                  connect_timeout=5.0) as worker:
        with pytest.raises((HandshakeError, ProtocolError), match="payload|too large|exceeds"):
            worker.connect()

    def forging(raw: Raw) -> None:
        raw.frame()
        raw.send(codec.encode_reject(0, "no\n2026-12-07 00:00:00,000 INFO meshlm: stage 0 linked" + "y" * 50_000))

    with fake_leader(forging) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                     secret=SECRET) as worker:
        with pytest.raises(HandshakeError) as info:
            worker.connect()
    text = str(info.value)
    assert "\n" not in text and "no\\n2026" in text and len(text) < 600


# -- hostile or broken peers after the handshake --------------------------------------------------


@contextmanager
def misbehaving_leader(frames: list[bytes]) -> Iterator[int]:
    """A leader that holds the secret and shakes hands properly, then sends `frames` verbatim."""

    def script(raw: Raw) -> None:
        leader_handshake(raw)
        raw.send(b"".join(frames))

    with fake_leader(script) as port:
        yield port


def _corrupt(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0x40])


GOOD_PLAN = encode(plan(0))


@pytest.mark.parametrize(
    "frames, message",
    [
        ([_corrupt(encode_frame(Kind.PLAN, 2, GOOD_PLAN))], "checksum mismatch"),
        ([encode_frame(Kind.PLAN, 3, GOOD_PLAN)], "sequence 3 .* expected 2: gap"),
        ([encode_frame(Kind.PLAN, 1, GOOD_PLAN)], "sequence 1 .* expected 2: duplicate"),
        ([encode_frame(Kind.HEARTBEAT, 2), encode_frame(Kind.HEARTBEAT, 2)], "duplicate"),
        ([encode_frame(Kind.ACK, 2, encode(Ack(0, 0)))], "unexpected ACK"),
        ([encode_frame(Kind.CHALLENGE, 2, encode(Challenge(b"x" * 32)))], "unexpected CHALLENGE frame after the handshake"),
        ([b"MLCP" + struct.pack("<H", codec.VERSION + 1) + encode_frame(Kind.PLAN, 2, GOOD_PLAN)[6:]],
         f"protocol version {codec.VERSION + 1}"),
        ([encode_frame(Kind.PLAN, 2, GOOD_PLAN[:-1])], "invalid PLAN payload"),
        ([encode_frame(Kind.HEARTBEAT, 2, b"x")], "trailing garbage in HEARTBEAT"),
    ],
)
def test_worker_refuses_bad_frames_from_the_leader(frames, message):
    with misbehaving_leader(frames) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2,
                                                           secret=SECRET) as worker:
        worker.connect()
        with pytest.raises(ProtocolError, match=message):
            worker.next_plan()


AHEAD_PLAN = encode(StepPlan(0, chunks=(Chunk(1, 0, (0,), LOGITS_LAST),), ids_follow=True))


@pytest.mark.parametrize(
    "frames, message",
    [
        ([encode_frame(Kind.TOKENS, 3, encode(TokenIds(1, (5,))))], "ids of step 1 .* step 0 waits for 1"),
        ([encode_frame(Kind.TOKENS, 3, encode(TokenIds(0, (5, 6))))], "ids of step 0 \\(2\\) where step 0 waits for 1"),
        ([encode_frame(Kind.PLAN, 3, GOOD_PLAN)], "a plan arrived before the ids of step 0"),
        ([encode_frame(Kind.TOKENS, 3, b"\x92\x00")], "invalid TOKENS payload"),
    ],
)
def test_worker_refuses_ids_that_do_not_follow_their_plan(frames, message):
    with misbehaving_leader([encode_frame(Kind.PLAN, 2, AHEAD_PLAN), *frames]) as port, \
            ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2, secret=SECRET) as worker:
        worker.connect()
        ahead = worker.next_plan()
        assert ahead.ids_follow
        with pytest.raises(ProtocolError, match=message):
            worker.next_ids(ahead)


def test_a_leader_gone_before_the_ids_is_leader_lost():
    with misbehaving_leader([encode_frame(Kind.PLAN, 2, AHEAD_PLAN)]) as port, \
            ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2, secret=SECRET) as worker:
        worker.connect()
        ahead = worker.next_plan()
        with pytest.raises(LeaderLost):
            worker.next_ids(ahead)


def test_ids_with_no_plan_waiting_are_refused():
    with misbehaving_leader([encode_frame(Kind.TOKENS, 2, encode(TokenIds(0, (5,))))]) as port, \
            ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2, secret=SECRET) as worker:
        worker.connect()
        with pytest.raises(ProtocolError, match="TOKENS frame with no plan waiting"):
            worker.next_plan()


@contextmanager
def fake_worker(leader: ControlLeader) -> Iterator[socket.socket]:
    """A raw socket that joins as rank 1 with the right secret and reads WELCOME; the test writes what it likes."""
    waiting = Waiting(leader)
    raw = Raw.connect(leader.port)
    for frame in hello_frames(decode(Kind.CHALLENGE, raw.frame().payload).nonce, SECRET):
        raw.send(frame)
    waiting.outcome()
    assert raw.frame().kind is Kind.WELCOME
    try:
        yield raw.sock
    finally:
        raw.close()


@pytest.mark.parametrize(
    "ack_frame, message",
    [
        (_corrupt(encode_frame(Kind.ACK, 2, encode(Ack(0, 0)))), "rank 1: checksum mismatch"),
        (encode_frame(Kind.ACK, 5, encode(Ack(0, 0))), "rank 1: sequence 5"),
        (encode_frame(Kind.ACK, 2, encode(Ack(7, 0))), "rank 1 acked step 7, expected step 0"),
        (encode_frame(Kind.HELLO, 2, encode(Hello(1, 2, b"w" * 32))), "rank 1 sent HELLO after"),
        (encode_frame(Kind.PROOF, 2, encode(Proof(b"m" * 32))), "rank 1 sent PROOF after the handshake"),
        (encode_frame(Kind.PLAN, 2, GOOD_PLAN), "rank 1: unexpected PLAN frame"),
    ],
)
def test_leader_refuses_bad_frames_from_a_worker(ack_frame, message):
    leader = ControlLeader(world_size=2, timeout=2.0, fingerprint=FP, secret=SECRET)
    with fake_worker(leader) as sock:
        leader.broadcast(plan(0))
        sock.sendall(ack_frame)
        with pytest.raises(ProtocolError, match=message):
            leader.collect_acks(0)
    leader.close()


@pytest.mark.parametrize(
    "frame, message",
    [
        (encode_frame(Kind.LOADED, 2, encode(codec.Loaded(FP, -1))), "rank 1 says it holds -1 KV blocks"),
        (encode_frame(Kind.ACK, 2, encode(Ack(0, 0))), "rank 1 sent ACK before LOADED"),
        (encode_frame(Kind.LOADED, 2, b"\x92"), "rank 1: invalid LOADED payload"),
        (encode_frame(Kind.LOADED, 3, encode(codec.Loaded(FP, 1))), "rank 1: sequence 3"),
    ],
)
def test_leader_refuses_a_bad_loaded_frame(frame, message):
    leader = ControlLeader(world_size=2, timeout=2.0, fingerprint=FP, secret=SECRET)
    with fake_worker(leader) as sock:
        sock.sendall(frame)
        with pytest.raises(ProtocolError, match=message):
            leader.start()
    leader.close()


def test_worker_whose_leader_hangs_up_before_the_start_says_so_at_once():
    def quitter(raw: Raw) -> None:
        leader_handshake(raw)
        assert raw.frame().kind is Kind.LOADED
        raw.close()

    with fake_leader(quitter) as port, ControlWorker("127.0.0.1", port, 1, 10.0, world_size=2,
                                                     secret=SECRET) as worker:
        worker.connect()
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="rank 1: the leader hung up before the cluster started"):
            worker.start(FP)
        assert time.monotonic() - t0 < 2


def test_worker_refuses_a_plan_in_place_of_the_start():
    def eager(raw: Raw) -> None:
        leader_handshake(raw)
        raw.frame()
        raw.send(encode_frame(Kind.PLAN, 2, GOOD_PLAN))

    with fake_leader(eager) as port, ControlWorker("127.0.0.1", port, 1, 2.0, world_size=2, secret=SECRET) as worker:
        worker.connect()
        with pytest.raises(ProtocolError, match="expected START or REJECT, got PLAN"):
            worker.start(FP)


# -- a process stopped past its deadline (SIGSTOP, then SIGCONT) ------------------------------------------


class _BlindSelector:
    """What a wait interrupted by a stop reports once continued past its deadline: nothing, whatever arrived."""

    def select(self, timeout=None):
        return []

    def close(self):
        pass


def test_a_link_reads_once_more_before_calling_a_buffered_frame_a_timeout():
    from meshlm.transport.link import Link

    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
    with a, b:
        link = Link(b, frozenset(Kind), 1 << 20)
        link._sel = _BlindSelector()
        a.sendall(encode_frame(Kind.HEARTBEAT, 0))
        # Before: LinkTimeout, and a worker continued after its leader's SHUTDOWN told the leader it had
        # heard nothing for --worker-timeout, instead of the leader's own reason.
        assert link.recv(time.monotonic() - 1).kind is Kind.HEARTBEAT


def test_the_leader_reads_once_more_before_calling_an_arrived_ack_missing(monkeypatch):
    real = control.wait_readable
    blind = lambda links, deadline: [] if deadline != 0 else real(links, 0)  # noqa: E731
    acked = threading.Event()

    def ack(w, p):
        w.ack(p.step_id, 0)
        acked.set()

    with cluster(2, on_plan=ack) as (leader, _):
        leader.broadcast(plan(0))
        assert acked.wait(TIMEOUT)  # sent over loopback: in the leader's socket
        monkeypatch.setattr(control, "wait_readable", blind)
        assert set(leader.collect_acks(0, timeout=0.01)) == {1}


def _from(host: str, port: int) -> socket.socket:
    """A connection to the leader from another loopback address (another host, as the leader sees it)."""
    sock = socket.socket()
    sock.bind((host, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _slow_proof(monkeypatch, seconds: float) -> None:
    """Workers send their PROOF `seconds` late, as one a WAN round trip away does."""
    send = ControlWorker._send

    def late(self, kind, payload):
        if kind is Kind.PROOF:
            time.sleep(seconds)
        return send(self, kind, payload)

    monkeypatch.setattr(ControlWorker, "_send", late)


def test_a_flood_from_one_host_neither_evicts_a_worker_of_another_nor_floods_the_log(monkeypatch, caplog):
    """Past 32 unproven connections the leader dropped the oldest, a real worker still proving itself
    among them: told 'too many unauthenticated connections', it exited and the start failed. Each
    dropped connection was a warning: ~1,500 lines a second."""
    _slow_proof(monkeypatch, 0.5)
    leader = _leader()
    waiting = Waiting(leader)
    workers = _start(leader.port, 2, [(1, FP)])
    time.sleep(0.1)  # the worker's connection is the oldest one waiting
    flood = []
    for _ in range(3 * control.MAX_CANDIDATES):
        with contextlib.suppress(ConnectionRefusedError):  # the listen backlog overflows now and then
            flood.append(_from("127.0.0.2", leader.port))
    assert set(waiting.outcome()) == {1}
    assert "trying again" not in caplog.text  # never evicted
    assert leader._refusals.count > 0  # the flood did fill the slots
    _serve_one_plan(leader, workers)
    assert len(re.findall("dropped connection from", caplog.text)) <= 6, caplog.text[-2000:]
    for sock in flood:
        sock.close()


def test_a_worker_dropped_to_make_room_tries_again(monkeypatch, caplog):
    """Strangers from enough hosts can still fill the leader's slots: an evicted worker is told BUSY, and
    it connects again until its deadline instead of failing the start."""
    caplog.set_level(logging.INFO, logger="meshlm.transport.control")
    _slow_proof(monkeypatch, 0.3)
    monkeypatch.setattr(control, "MAX_CANDIDATES", 1)
    leader = _leader()
    waiting = Waiting(leader)
    workers = _start(leader.port, 2, [(1, FP)])
    time.sleep(0.1)
    strangers = [_from(f"127.0.0.{i}", leader.port) for i in (2, 3, 4)]  # each evicts the one before
    assert set(waiting.outcome()) == {1}
    assert "too many unauthenticated connections; trying again" in caplog.text
    _serve_one_plan(leader, workers)
    for sock in strangers:
        sock.close()


def test_silent_strangers_from_many_hosts_are_dropped_before_a_worker_that_spoke(monkeypatch, caplog):
    """Each stranger on an address of its own ties every host at one connection: the oldest overall, the
    worker still proving itself, was the one dropped. A worker sends its HELLO as it connects, so
    connections that said nothing go first."""
    caplog.set_level(logging.INFO, logger="meshlm.transport.control")
    _slow_proof(monkeypatch, 0.5)
    leader = _leader()
    waiting = Waiting(leader)
    workers = _start(leader.port, 2, [(1, FP)])
    time.sleep(0.1)
    flood = []
    for i in range(2 * control.MAX_CANDIDATES):
        with contextlib.suppress(ConnectionRefusedError):
            flood.append(_from(f"127.0.1.{i + 1}", leader.port))
    assert set(waiting.outcome()) == {1}
    assert "trying again" not in caplog.text and leader._refusals.count > 0
    _serve_one_plan(leader, workers)
    for sock in flood:
        sock.close()
