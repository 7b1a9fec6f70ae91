"""Leader -> worker control channel for tensor parallelism (pure Python, no MLX).

One plain TCP connection per worker, framed by `codec`. Plain sockets rather
than pyzmq because a dead peer must be *noticed*: the kernel closes a killed
process's socket, so the leader reads EOF at once, while zmq reconnects
silently and can drop or replay messages across a reconnect, which would break
the sequence-number invariant. Every wait below has a deadline.

Protocol:
  1. The roll call, before any rank joins the MLX group or loads a weight:
     each worker connects (retrying until its deadline) and proves it holds
     the cluster secret (`auth`: CHALLENGE, HELLO with rank and world size,
     then PROOF). A connection that cannot is dropped and the leader keeps
     waiting; a peer of another protocol version ends the start. Once every
     rank 1..N-1 has proved itself the leader sends each one WELCOME with its
     own proof. Any misfit: REJECT(reason) to everyone and `HandshakeError`
     on both sides.
  2. The start: each rank loads its share while its connection stays open
     (so a rank that dies meanwhile is noticed at once, not at a deadline),
     then sends LOADED with its model fingerprint and KV budget. Once every
     rank has, with the same fingerprint, the leader sends START.
  3. The leader broadcasts PLAN frames (identical bytes to every worker, so
     leader->worker sequence numbers agree across ranks), HEARTBEAT when idle,
     SHUTDOWN at the end.
  4. After applying a plan a worker sends ACK(step_id, its batch fingerprint,
     error). Acks come back in plan order; the leader may collect them late
     (pipelining) but checks every one.

Failures surface as `ControlError` subclasses: `HandshakeError`,
`ProtocolError`, `WorkerLost`, `WorkerFailed`, `SplitBrain` (leader side) and
`LeaderLost` (worker side).
"""

from __future__ import annotations

import collections
import logging
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType

from meshlm.engine.plan import StepPlan
from meshlm.transport import codec as wire
from meshlm.transport.auth import (BUSY, Candidate, ClusterSecret, HandshakeError, Joining, LeaderBusy, Refused,
                                  new_nonce, prove_worker)
from meshlm.transport.codec import (Ack, ControlError, Frame, Hello, Kind, Loaded, ProtocolError, TokenIds,
                                    VersionMismatch, Welcome)
from meshlm.transport.handshakes import RefusalLog, host_key
from meshlm.transport.link import Link, LinkClosed, LinkTimeout, hung_up, remaining, tune, wait_readable
from meshlm.step_times import check_totals

__all__ = ["Ack", "ControlError", "ControlLeader", "ControlWorker", "HandshakeError", "LeaderLost", "Loaded",
           "ProtocolError", "SplitBrain", "WorkerFailed", "WorkerLost"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
AUTH_TIMEOUT = 10.0  # a real worker proves itself within a round trip of being accepted
MAX_CANDIDATES = 32  # unauthenticated connections held at once during the handshake
MAX_HELLO_BYTES = 64 << 10  # an unproven peer cannot make the leader buffer more than this
SILENCE_POLL_S = 0.5  # how often a wait for acks also checks that every worker still heartbeats
GONE_POLL_S = 0.25  # how often the handshake asks whether a rank will never come
ROLL_CALL_REPORT_S = 15.0  # how often the roll call says whom it still waits for (a hand-started rank may never come)


class LeaderLost(ControlError):
    """Worker side: the leader closed the connection or went silent past the timeout."""


class WorkerLost(ControlError):
    """Leader side: a worker's connection closed, failed, or it missed a deadline."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"worker rank {rank} lost: {reason}")
        self.rank = rank
        self.reason = reason


class WorkerFailed(ControlError):
    """A worker reported that it could not apply a plan (the error text comes from its ACK)."""

    def __init__(self, rank: int, step_id: int, error: str) -> None:
        super().__init__(f"worker rank {rank} failed step {step_id}: {error}")
        self.rank, self.step_id, self.error = rank, step_id, error


class SplitBrain(ControlError):
    """A worker's batch fingerprint after a step differs from the leader's: ranks diverged."""

    def __init__(self, rank: int, step_id: int, expected: int, actual: int) -> None:
        super().__init__(f"split brain at step {step_id}: rank {rank} batch fingerprint {actual:#018x}, "
                         f"leader expects {expected:#018x}")
        self.rank, self.step_id, self.expected, self.actual = rank, step_id, expected, actual


# -- leader -------------------------------------------------------------------------


def _last_words(link: Link) -> Ack | str | None:
    """Why a worker left, from a closed link's buffered frames: its error ACK (a failed step), or its
    REJECT's reason (`ControlWorker.leave`); None when it said nothing."""
    try:
        while (frame := link.next_frame()) is not None:
            if frame.kind is Kind.ACK:
                ack = wire.decode(Kind.ACK, frame.payload)
                if ack.error:
                    return ack
            elif frame.kind is Kind.REJECT:
                return wire.decode_reason(frame.payload)
    except ControlError:
        pass
    return None


def _reason(frame: Frame) -> str:
    try:
        return wire.decode_reason(frame.payload)
    except ControlError as e:
        return f"(an unreadable reason: {e})"


def _message(rank: int, frame: Frame, kind: Kind, out_of_turn: str):
    """The message in `rank`'s `frame`, which must be of `kind` (else it was sent `out_of_turn`); any
    problem is a ProtocolError naming the rank."""
    if frame.kind is not kind:
        raise ProtocolError(f"rank {rank} sent {frame.kind.name} {out_of_turn}")
    try:
        return wire.decode(kind, frame.payload)
    except ProtocolError as e:
        raise ProtocolError(f"rank {rank}: {e}") from None


def _candidates(sel: selectors.BaseSelector) -> list[Candidate]:
    return [key.data for key in sel.get_map().values() if isinstance(key.data, Candidate)]


class ControlLeader:
    """Rank 0's end: admits the workers, broadcasts plans, collects acks, notices dead workers.

    Thread-safe (one lock), so a helper thread may call `maybe_heartbeat` while
    the engine thread broadcasts. After any `ControlError` the cluster is
    unusable: call `shutdown()` (best effort to the survivors) and start over.
    """

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, world_size: int = 2,
                 timeout: float = DEFAULT_TIMEOUT, *, secret: ClusterSecret, fingerprint: str | None = None,
                 heartbeat_interval: float = 1.0, auth_timeout: float = AUTH_TIMEOUT,
                 max_payload: int = wire.DEFAULT_MAX_PAYLOAD, silence_timeout: float | None = None) -> None:
        """Bind now (port 0 picks a free one, see `.port`); workers are admitted by `wait_for_workers` and
        started by `start`.

        `secret`: only workers that prove they hold it are admitted. `fingerprint`:
        the leader's model fingerprint (may be set once it has loaded, before
        `start`); every worker must match it. None: workers must only agree with
        each other. `timeout` bounds each round of the handshake, every ack wait
        and every send unless a call passes its own. `auth_timeout`: how long one
        connection may take to prove itself before it is dropped. `silence_timeout`: how long a started
        worker may send nothing, not even a heartbeat (`ControlWorker.beat`), before it is lost: a stopped
        or hung process, or an unreachable host, is found then rather than at the step's deadline (which a
        big model's long step needs). None: only a closed connection or a missed ack deadline loses it.
        """
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        self.world_size = world_size
        self.timeout = timeout
        self.fingerprint = fingerprint
        self.heartbeat_interval = heartbeat_interval
        self.silence_timeout = silence_timeout
        self._started_at: float | None = None  # the workers heartbeat from the start on
        self._silence_checked = 0.0
        self.auth_timeout = auth_timeout
        self.max_payload = max_payload
        self._secret = secret
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.create_server((bind_host, port), family=family, backlog=world_size + MAX_CANDIDATES)
        self.host, self.port = self._listener.getsockname()[:2]
        self._links: dict[int, Link] = {}  # rank -> link, once admitted
        # Why each lost link was lost: the watchdog's probe often sees a death first, and the engine's
        # diagnosis of the collective that failed with it must still be told which rank it was.
        self._lost: dict[int, ControlError] = {}
        self._pending: dict[int, collections.deque[tuple[int, int]]] = {}  # rank -> (step_id, fingerprint) unacked
        self._seq = 0  # leader -> worker sequence number, shared by every link
        self._last_step = -1
        self._last_send = time.monotonic()
        self._lock = threading.RLock()
        # Socket writes and the sequence numbers: `pulse` takes only this one, so that it heartbeats while
        # the engine thread holds the other waiting for acks.
        self._send_lock = threading.Lock()
        self._closed = threading.Event()  # ends the pulse thread (`_keep_pulsing`)
        self._refusals = RefusalLog(log, "control: dropped connection from %s during the handshake: %s")
        # Unproven connections held per host: every worker of a cluster on one machine, and a few more
        self._per_host = min(MAX_CANDIDATES, world_size + 3)
        self.worker_times: dict[int, tuple[float, ...]] = {}  # rank -> its seconds by phase, from its last ACK
        self.worker_sums: dict[int, tuple[int, float, float]] = {}  # rank -> its shared-memory sums (Ack.sums)

    # -- handshake ------------------------------------------------------------------

    def wait_for_workers(self, timeout: float | None = None,
                         gone: Callable[[], str | None] | None = None) -> dict[int, Hello]:
        """The roll call: admit ranks 1..N-1, then WELCOME them all. Raises HandshakeError naming missing or
        bad ranks. `gone`: why a rank will never come (a local worker that exited), asked a few times a second.

        A connection that does not prove it holds the secret is dropped (with a
        warning naming its address) and the wait goes on; a peer of another
        protocol version, or a proven worker that does not fit, ends it at once.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        report = time.monotonic() + ROLL_CALL_REPORT_S
        admitted: dict[int, Candidate] = {}
        with self._lock, selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            try:
                while len(admitted) < self.world_size - 1:
                    why = gone() if gone is not None else None
                    if why is not None:
                        raise HandshakeError(why)
                    if time.monotonic() >= report:
                        report = time.monotonic() + ROLL_CALL_REPORT_S
                        log.info("%s; %.0f s left", self._missing_message(admitted, waiting=True), remaining(deadline))
                    poll = min(GONE_POLL_S if gone is not None else ROLL_CALL_REPORT_S, remaining(report))
                    self._handshake_round(sel, admitted, deadline, poll)
                self._welcome_all(admitted)
            except BaseException as e:
                self._abort(f"cluster start aborted: {e}")
                raise
            finally:
                self._close_unadmitted(sel)
                self._refusals.close()
        self._listener.close()  # a static world: late or extra workers must not get in
        return {rank: c.hello for rank, c in admitted.items() if c.hello is not None}

    def start(self, timeout: float | None = None, before_start: Callable[[], None] | None = None,
              gone: Callable[[], str | None] | None = None) -> dict[int, Loaded]:
        """Wait for every welcomed rank's LOADED, check all loaded the same model, then START them all.

        A rank that hangs up meanwhile (it died loading) ends the wait at once; so does `gone` (as in
        `wait_for_workers`). Raises HandshakeError (telling every rank why) naming the rank.
        `before_start` runs once every rank has loaded (what the workers use once started).
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        loaded: dict[int, Loaded] = {}
        with self._lock:
            try:
                while True:
                    why = gone() if gone is not None else None
                    if why is not None:
                        raise HandshakeError(why)
                    waiting = self._take_loaded(loaded)
                    if not waiting:
                        break
                    if remaining(deadline) == 0:
                        raise HandshakeError(f"rank(s) {', '.join(map(str, waiting))} did not finish loading within "
                                             f"{self.timeout if timeout is None else timeout:.0f} s of the leader")
                    wake = min([deadline] + ([time.monotonic() + GONE_POLL_S] if gone is not None else []))
                    for link in wait_readable([self._links[r] for r in waiting], wake):
                        self._read_loading(self._rank_of(link), link)
                if before_start is not None:
                    before_start()
                self._send_all(Kind.START, b"")
                self._started_at = time.monotonic()
                threading.Thread(target=self._keep_pulsing, name="meshlm-pulse", daemon=True).start()
            except BaseException as e:
                self._abort(f"cluster start aborted: {e}")
                raise
        return loaded

    def _take_loaded(self, loaded: dict[int, Loaded]) -> list[int]:
        """Check each LOADED that has arrived into `loaded`; the ranks still loading."""
        waiting = []
        for rank in sorted(set(self._links) - set(loaded)):
            frame = self._frame(rank)
            if frame is None:
                waiting.append(rank)
                continue
            msg = _message(rank, frame, Kind.LOADED, "before LOADED")
            if msg.kv_blocks < 0:
                raise ProtocolError(f"rank {rank} says it holds {msg.kv_blocks} KV blocks")
            expected = self.fingerprint if self.fingerprint is not None else \
                next((m.fingerprint for m in loaded.values()), msg.fingerprint)
            if msg.fingerprint != expected:
                source = "the leader's" if self.fingerprint is not None else f"rank {min(loaded)}'s"
                raise HandshakeError(f"rank {rank} loaded model fingerprint {msg.fingerprint!r} but {source} is "
                                     f"{expected!r}: every rank must load the same model revision")
            loaded[rank] = msg
        return waiting

    def _read_loading(self, rank: int, link: Link) -> None:
        try:
            link.read_available()
        except LinkClosed as e:
            raise self._lose(rank, HandshakeError(
                f"rank {rank} hung up before it had loaded its share ({e}; {link.peer}): its process died "
                "or its host became unreachable, and its own log says why")) from None

    def _handshake_round(self, sel: selectors.BaseSelector, admitted: dict[int, Candidate], deadline: float,
                         poll: float | None = None) -> None:
        if remaining(deadline) == 0:
            raise HandshakeError(self._missing_message(admitted))
        self._expire(sel)
        wake = min([remaining(deadline)] + [remaining(c.deadline) for c in _candidates(sel)]
                   + ([poll] if poll is not None else []))
        for key, _ in sel.select(wake):
            if key.fileobj is self._listener:
                self._accept(sel)
            else:
                self._advance(sel, key.data, admitted)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            sock, addr = self._listener.accept()
        except OSError:
            return
        tune(sock, max(self.timeout, 5.0))
        cand = Candidate(Link(sock, wire.WORKER_KINDS, MAX_HELLO_BYTES), time.monotonic() + self.auth_timeout,
                         host=host_key(addr[0]))
        # A flood of strangers must not exhaust file descriptors, nor evict a real worker: room is made
        # among the new connection's host when it holds its share, else among all, preferring one that
        # has said nothing (a worker sends its HELLO as it connects), then one of the host holding the
        # most, then the oldest. Strangers from many addresses that send HELLOs can still evict a worker:
        # it is told BUSY and tries again.
        waiting = _candidates(sel)
        mine = [c for c in waiting if c.host == cand.host]
        if len(mine) >= self._per_host or len(waiting) >= MAX_CANDIDATES:
            pool = mine if len(mine) >= self._per_host else waiting
            held = collections.Counter(c.host for c in waiting)
            self._drop(sel, min(pool, key=lambda c: (c.hello is not None, -held[c.host], c.deadline)), BUSY)
        try:
            cand.link.send(cand.challenge(), timeout=1.0)
        except LinkClosed:
            cand.link.close()
            return
        sel.register(sock, selectors.EVENT_READ, cand)

    def _advance(self, sel: selectors.BaseSelector, cand: Candidate, admitted: dict[int, Candidate]) -> None:
        if cand.link.closed:  # dropped earlier in this round to make room
            return
        try:
            hello = cand.authenticate(self._secret)
        except VersionMismatch as e:
            # A rank of another build, told why in its own version (it fails at once on its side), or anyone
            # writing 28 bytes: unproven, it ends this connection only (it ended the cluster's start), and the
            # deadline's message names it
            problem = (f"speaks control protocol version {e.version}, this leader speaks {wire.VERSION}: all "
                       "ranks must run the same meshlm version")
            self._drop(sel, cand, problem, version=e.version)
            return
        except (Refused, ProtocolError, LinkClosed) as e:
            # A stranger (port scan, wrong service, wrong secret) must not abort the cluster: drop it, remember why.
            self._drop(sel, cand, str(e))
            return
        if hello is None:
            return
        sel.unregister(cand.link.sock)
        if problem := self._hello_problem(hello, admitted):  # a proven worker that does not fit: abort loudly
            self._reject(cand.link, problem)
            raise HandshakeError(problem)
        admitted[hello.rank] = cand
        cand.link.decoder.max_payload = self.max_payload  # proven: its ACKs may be as large as any frame
        self._links[hello.rank] = cand.link
        self._pending[hello.rank] = collections.deque()

    def _expire(self, sel: selectors.BaseSelector) -> None:
        for cand in _candidates(sel):
            if remaining(cand.deadline) == 0:
                self._drop(sel, cand, f"no HELLO and PROOF within {self.auth_timeout:.1f} s")

    def _drop(self, sel: selectors.BaseSelector, cand: Candidate, reason: str, version: int = wire.VERSION) -> None:
        """Refuse one unauthenticated connection (in its protocol `version`); the reason names no secret and
        no proof."""
        self._refusals.refused(cand.link.peer, reason)
        sel.unregister(cand.link.sock)
        self._reject(cand.link, reason, version)

    def _hello_problem(self, hello: Hello, admitted: dict[int, Candidate]) -> str | None:
        r = hello.rank
        if hello.world_size != self.world_size:
            return f"rank {r} was started with world size {hello.world_size}, the leader with {self.world_size}"
        if not 1 <= r < self.world_size:
            return f"worker claims rank {r}; worker ranks are 1..{self.world_size - 1}"
        if r in admitted:
            return f"two workers claim rank {r}"
        return None

    def _missing_message(self, admitted: dict[int, Candidate], waiting: bool = False) -> str:
        missing = [r for r in range(1, self.world_size) if r not in admitted]
        msg = f"{'still waiting' if waiting else 'timed out waiting'} for workers on port {self.port}: missing ranks {missing}"
        if self._refusals.count:
            dropped = self._refusals.latest()
            latest = f" (latest {len(dropped)})" if self._refusals.count > len(dropped) else ""
            msg += f"; refused {self._refusals.count} connection(s){latest}: {'; '.join(dropped)}"
        return msg

    def _welcome_all(self, admitted: dict[int, Candidate]) -> None:
        """WELCOME (seq 1) to every worker, each with the leader's proof for that worker's nonce."""
        for rank in sorted(admitted):
            cand = admitted[rank]
            try:
                cand.link.send(cand.welcome(self._secret, self.world_size), self.timeout)
            except LinkClosed as e:
                raise self._lose(rank, WorkerLost(rank, f"{e} ({cand.link.peer})")) from None
        self._seq = 2  # CHALLENGE and WELCOME went out as 0 and 1 on every link
        self._last_send = time.monotonic()

    def _reject(self, link: Link, reason: str, version: int = wire.VERSION) -> None:
        try:
            link.send(wire.encode_reject(max(self._seq, 1), reason, version), timeout=1.0)
            link.read_available()  # closing with unread bytes would reset the connection, REJECT unread
        except (LinkClosed, ProtocolError):
            pass
        link.close()

    def _abort(self, reason: str) -> None:
        """Tell admitted workers why the cluster will not start, then close everything."""
        for link in self._links.values():
            self._reject(link, reason)
        self._links.clear()
        self._pending.clear()
        self._listener.close()

    def _close_unadmitted(self, sel: selectors.BaseSelector) -> None:
        """Refuse the connections still in their handshake once the cluster has formed (or failed to form),
        saying why: what a connection already sent is judged first, so a wrong secret hears so even
        when a real worker proved itself sooner. A plain close used to leave its unread PROOF in our
        buffer, and the kernel then reset the connection: the peer learned nothing."""
        for cand in _candidates(sel):
            reason = "the leader stopped admitting workers (its cluster formed, or its start was aborted) before " \
                     "this connection proved itself"
            try:
                cand.authenticate(self._secret)
            except (Refused, ProtocolError) as e:
                reason = str(e)
            except (LinkClosed, VersionMismatch, HandshakeError):
                pass
            self._drop(sel, cand, reason)  # logged and refused as any other stranger

    # -- steady state ---------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        return sorted(self._links)

    def sockets(self) -> dict[int, socket.socket]:
        """Each admitted worker's connection, watched for a hang-up while the MLX group forms (join_watch.py)."""
        return {r: link.sock for r, link in self._links.items() if not link.closed}

    def broadcast(self, plan: StepPlan) -> int:
        """Send `plan` to every worker; returns its sequence number. Step ids must increase."""
        with self._lock:
            if plan.step_id <= self._last_step:
                raise ValueError(f"step {plan.step_id} broadcast after step {self._last_step}; step ids must increase")
            seq = self._send_all(Kind.PLAN, wire.encode_plan(plan))
            self._last_step = plan.step_id
            for pending in self._pending.values():
                pending.append((plan.step_id, plan.fingerprint))
            return seq

    def send_ids(self, step_id: int, ids: list[int]) -> None:
        """The input ids of plan `step_id`, broadcast with `ids_follow` before they were sampled."""
        with self._lock:
            if step_id != self._last_step:
                raise ValueError(f"ids of step {step_id} after plan {self._last_step}: they follow their own plan")
            self._send_all(Kind.TOKENS, wire.encode(TokenIds(step_id, tuple(ids))))

    def heartbeat(self) -> None:
        """Tell idle workers the leader is alive; first notice any worker that died meanwhile."""
        with self._lock:
            self.check_workers()
            self._send_all(Kind.HEARTBEAT, b"")

    def maybe_heartbeat(self) -> bool:
        """Call often from an idle loop: checks liveness, sends a heartbeat when one is due."""
        with self._lock:
            self.check_workers()
            if time.monotonic() - self._last_send < self.heartbeat_interval:
                return False
            self._send_all(Kind.HEARTBEAT, b"")
            return True

    def _keep_pulsing(self) -> None:
        """From the start until the close, a thread of its own: `pulse` when a heartbeat may be due."""
        while not self._closed.wait(self.heartbeat_interval / 2):
            try:
                self.pulse()
            except Exception:  # the engine thread meets whatever this was at its next word to the workers
                log.debug("pulse failed", exc_info=True)

    def pulse(self) -> None:
        """While the engine thread is busy for long without a word to the workers (a long prompt's
        forward, a pipeline's leader running its own stage or waiting for an activation, a draft model
        loading before the engine starts): a heartbeat when one is due, so no waiting worker takes the
        silence for a dead leader (it gave up after --worker-timeout, and a healthy cluster failed).
        Reads nothing, and a failed send is left for the engine thread to meet and name."""
        with self._send_lock:
            if (time.monotonic() - self._last_send < self.heartbeat_interval
                    or any(link.closed for link in self._links.values())):
                return
            _, data = self._next_frame(Kind.HEARTBEAT, b"")
            for rank in sorted(self._links):
                try:
                    self._links[rank].send(data, self.timeout)
                except LinkClosed:
                    return

    def check_workers(self) -> None:
        """Non-blocking: raise WorkerLost for a worker whose connection closed (e.g. process killed)."""
        with self._lock:
            if self._lost:  # a loss seen before (by the watchdog's probe, say) is still the cause
                raise self._lost[min(self._lost)]
            for link in wait_readable(self._live_links(), deadline=0):
                self._read(self._rank_of(link), link)
            self._check_silence()

    def _check_silence(self) -> None:
        """Lose the first started worker silent past `silence_timeout`. Call right after reading what
        every link holds: a link is heard when the leader reads it, so a leader that was busy is not misled."""
        if self.silence_timeout is None or self._started_at is None:
            return
        now = time.monotonic()
        self._silence_checked = now
        for rank in sorted(self._links):
            link = self._links[rank]
            silent = now - max(link.last_heard, self._started_at)
            if not link.closed and silent > self.silence_timeout:
                raise self._lose(rank, WorkerLost(rank, f"nothing from it, not even a heartbeat, for {silent:.1f} s "
                                                        f"({link.peer}; its process is stopped or hung, or its "
                                                        "host unreachable)"))

    def check_arrived_acks(self) -> None:
        """Non-blocking, for diagnosing a step that failed or outlived its deadline: read what the workers
        sent and check every ACK already in, so a split brain (an ACK whose fingerprint differs from its
        plan's) or a worker's own error is named rather than the deadline. Consumes those ACKs: not for
        a cluster that goes on."""
        with self._lock:
            self.check_workers()
            for rank in sorted(self._links):
                while self._pending[rank] and (frame := self._frame(rank)) is not None:
                    self._check_ack(rank, frame)

    def collect_acks(self, step_id: int, timeout: float | None = None) -> dict[int, Ack]:
        """Wait for every worker's ACK up to `step_id`, checking each (also earlier, uncollected ones).

        Raises WorkerLost (closed, or no ack by the deadline), WorkerFailed
        (the worker reported an error), SplitBrain (fingerprint differs from the
        plan's; plans with fingerprint 0 are not checked) or ProtocolError.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._check_outstanding(step_id)
            acks: dict[int, Ack] = {}
            waiting = set(self._links)
            while True:
                self._take_acks(waiting, step_id, acks)
                if not waiting:
                    return acks
                self._wait_for(waiting, step_id, deadline)

    def _check_outstanding(self, step_id: int) -> None:
        if self._links and not any(s == step_id for p in self._pending.values() for s, _ in p):
            raise ValueError(f"no outstanding acks for step {step_id}")

    def _take_acks(self, waiting: set[int], step_id: int, acks: dict[int, Ack]) -> None:
        for rank in sorted(waiting):
            while (frame := self._frame(rank)) is not None:
                ack = self._check_ack(rank, frame)
                if ack.step_id == step_id:
                    acks[rank] = ack
                    waiting.discard(rank)
                    break

    def _check_ack(self, rank: int, frame: Frame) -> Ack:
        if frame.kind is Kind.REJECT:  # a worker leaving on its own says why first (ControlWorker.leave)
            raise self._lose(rank, WorkerLost(rank, f"it left: {_reason(frame)}"))
        ack = _message(rank, frame, Kind.ACK, "after the handshake")
        if not self._pending[rank]:
            raise ProtocolError(f"rank {rank} acked step {ack.step_id}, but no plan is outstanding")
        step_id, fingerprint = self._pending[rank].popleft()
        if ack.step_id != step_id:
            raise ProtocolError(f"rank {rank} acked step {ack.step_id}, expected step {step_id}")
        if ack.error:
            raise WorkerFailed(rank, step_id, ack.error)
        if fingerprint and ack.fingerprint != fingerprint:
            raise SplitBrain(rank, step_id, fingerprint, ack.fingerprint)
        if ack.times:
            problem = check_totals(ack.times)
            if problem is not None:
                raise ProtocolError(f"rank {rank} acked step {step_id} with {problem}")
            self.worker_times[rank] = ack.times
        if ack.sums:
            if len(ack.sums) != 3 or not all(math.isfinite(x) and x >= 0 for x in ack.sums) or ack.sums[2] > ack.sums[1]:
                raise ProtocolError(f"rank {rank} acked step {step_id} with sums {ack.sums[:4]}: expected a count, "
                                    "seconds and seconds waiting (finite, >= 0, waiting within the seconds)")
            self.worker_sums[rank] = (int(ack.sums[0]), ack.sums[1], ack.sums[2])
        return ack

    def _frame(self, rank: int) -> Frame | None:
        """The rank's next buffered frame but a heartbeat (reading it was what mattered), or None."""
        try:
            while (frame := self._links[rank].next_frame()) is not None and frame.kind is Kind.HEARTBEAT:
                wire.decode_empty(frame.payload, "HEARTBEAT")
            return frame
        except ProtocolError as e:
            raise ProtocolError(f"rank {rank}: {e}") from None

    def _wait_for(self, waiting: set[int], step_id: int, deadline: float) -> None:
        self._require_live(waiting)
        links = [self._links[r] for r in sorted(waiting)]
        wake = deadline if self.silence_timeout is None else min(deadline, time.monotonic() + SILENCE_POLL_S)
        ready = wait_readable(links, wake)
        if not ready and remaining(deadline) == 0:
            # One last poll first: a leader stopped (SIGSTOP) past the deadline and continued wakes from an
            # interrupted wait with nothing reported, whatever arrived meanwhile.
            ready = wait_readable(links, 0)
            if not ready:
                others = sorted(waiting)[1:]
                extra = f" (also missing: ranks {others})" if others else ""
                first = min(waiting)
                raise self._lose(first, WorkerLost(first, f"no ACK for step {step_id} before the deadline{extra}"))
        for link in ready:
            self._read(self._rank_of(link), link)
        if self.silence_timeout is not None and time.monotonic() - self._silence_checked >= SILENCE_POLL_S:
            self.check_workers()  # also reads the ranks already acked, whose heartbeats would go unread

    def _read(self, rank: int, link: Link) -> None:
        try:
            link.read_available()
        except LinkClosed as e:
            said = _last_words(link)  # a worker that failed or left says why, then exits
            if isinstance(said, Ack):
                raise self._lose(rank, WorkerFailed(rank, said.step_id, said.error)) from None
            if said is not None:
                raise self._lose(rank, WorkerLost(rank, f"it left: {said}")) from None
            raise self._lose(rank, WorkerLost(rank, f"{e} ({link.peer}; process died or host unreachable)")) from None

    def _send_all(self, kind: Kind, payload: bytes) -> int:
        """One encoding, the same bytes (and sequence number) to every live worker."""
        self._require_live(self._links)
        with self._send_lock:
            seq, data = self._next_frame(kind, payload)
            for rank in sorted(self._links):
                link = self._links[rank]
                try:
                    link.send(data, self.timeout)
                except LinkClosed as e:
                    raise self._lose(rank, WorkerLost(rank, f"{e} ({link.peer})")) from None
        return seq

    def _next_frame(self, kind: Kind, payload: bytes) -> tuple[int, bytes]:
        """The next frame to every worker, and its sequence number (hold the send lock)."""
        seq = self._seq
        data = wire.encode_frame(kind, seq, payload, max_payload=self.max_payload)
        self._seq += 1
        self._last_send = time.monotonic()
        return seq, data

    def _require_live(self, ranks: Iterable[int]) -> None:
        for rank in sorted(ranks):
            if self._links[rank].closed:
                raise self._lost.get(rank) or WorkerLost(rank, "connection already lost")

    def _live_links(self) -> list[Link]:
        return [link for link in self._links.values() if not link.closed]

    def _rank_of(self, link: Link) -> int:
        return next(r for r, lk in self._links.items() if lk is link)

    def _lose(self, rank: int, why: ControlError) -> ControlError:
        """Close a rank's link for good and remember why; returns `why`, for the caller to raise."""
        self._links[rank].close()
        self._lost.setdefault(rank, why)
        return why

    # -- shutdown -------------------------------------------------------------------

    def shutdown(self, reason: str = "leader shutting down", linger: float = 2.0) -> None:
        """Best effort: SHUTDOWN to every live worker, wait up to `linger` s for them to hang up, close."""
        with self._lock, self._send_lock:
            _, frame = self._next_frame(Kind.SHUTDOWN, wire.encode_reason(reason))
            for link in self._live_links():
                self._send_quietly(link, frame)
            self._drain_until_closed(time.monotonic() + linger)
            self.close()

    def _send_quietly(self, link: Link, data: bytes) -> None:
        try:
            link.send(data, timeout=1.0)
            link.sock.shutdown(socket.SHUT_WR)
        except (LinkClosed, OSError):
            link.close()

    def _drain_until_closed(self, deadline: float) -> None:
        # Closing with unread bytes would send RST, which can destroy the SHUTDOWN frame in flight.
        while (live := self._live_links()) and remaining(deadline) > 0:
            for link in wait_readable(live, deadline):
                try:
                    link.read_available()
                    link.decoder = wire.FrameDecoder(self.max_payload)  # late acks no longer matter
                except LinkClosed:
                    link.close()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for link in self._links.values():
                link.close()
            self._listener.close()

    def __enter__(self) -> ControlLeader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown(reason=f"leader stopped: {exc}" if exc else "leader shutting down")


# -- worker -----------------------------------------------------------------------------


class ControlWorker:
    """A worker rank's end: connect and prove itself (before loading), say it has loaded and wait for the
    start, then receive plans in order and ACK them.

    w.connect(); load(); w.start(fingerprint)
    while (plan := w.next_plan()) is not None: apply(plan); w.ack(plan.step_id, fp)
    """

    def __init__(self, leader_host: str, port: int, rank: int, timeout: float = DEFAULT_TIMEOUT,
                 *, world_size: int, secret: ClusterSecret, connect_timeout: float | None = None,
                 max_payload: int = wire.DEFAULT_MAX_PAYLOAD) -> None:
        """`timeout`: longest silence from the leader (heartbeats included) before LeaderLost.
        `connect_timeout` (default `timeout`): how long to retry connecting and wait for WELCOME, and
        to wait for START once loaded; make it at least the leader's handshake timeout. `secret`:
        proves this rank to the leader, and the leader to this rank (no plan is accepted from a
        leader that cannot)."""
        if not 1 <= rank < world_size:
            raise ValueError(f"worker rank must be in 1..{world_size - 1}, got {rank}")
        self.leader_host, self.port = leader_host, port
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.max_payload = max_payload
        self._secret = secret
        self._link: Link | None = None
        self._seq = 0  # worker -> leader sequence number
        self._send_lock = threading.Lock()  # the heartbeat thread sends too (`beat`)
        self._last_send = time.monotonic()
        # When the last heartbeat arrived (time.perf_counter): the leader sends one before the first plan after
        # it idled, so a worker counts as waiting for a plan only the time since (`_serve_plans`).
        self.heard_at = 0.0
        self._beating = threading.Event()  # set: heartbeats stop
        self.shutdown_reason: str | None = None  # set when the leader sent SHUTDOWN

    def connect(self, gone: Callable[[], str | None] | None = None) -> Welcome:
        """The roll call: connect (retrying until the deadline), prove this rank, check the leader's proof.
        Raises HandshakeError. `gone`: why the leader will never listen (asked between connection attempts)."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            # Until the leader has proved itself, no frame above MAX_HELLO_BYTES: whoever holds the control
            # port could make this rank buffer a 64 MiB one first (helper-61: +130 MB)
            self._link = Link(self._dial(deadline, gone), wire.LEADER_KINDS, MAX_HELLO_BYTES)
            self._seq = 0
            try:
                joining = Joining(Hello(self.rank, self.world_size, new_nonce()), self._leader)
                welcome = prove_worker(self._link, self._send, self._secret, joining, deadline)
                self._link.decoder.max_payload = self.max_payload
                break
            except LeaderBusy as e:  # dropped to make room before it could prove itself: not a verdict
                self._link.close()  # the link only: close() would also stop this rank's heartbeats for good
                if remaining(deadline) == 0:
                    raise HandshakeError(str(e)) from None
                log.info("rank %d: %s; trying again", self.rank, e)
                time.sleep(min(0.2, remaining(deadline)))
            except LeaderLost as e:
                self.close()
                raise HandshakeError(str(e)) from None
            except BaseException:
                self.close()
                raise
        if welcome.world_size != self.world_size:
            self.close()
            raise HandshakeError(f"leader runs world size {welcome.world_size}, this rank expects {self.world_size}")
        return welcome

    def leader_hung_up(self) -> bool:
        """Non-blocking, from any thread, reading nothing: the leader's connection was closed or reset
        (its process died), or failed its keepalives (its host went away)."""
        return self._link is None or hung_up(self._link)

    def sockets(self) -> dict[int, socket.socket]:
        """The leader's connection, as rank 0's (see ControlLeader.sockets)."""
        return {0: self._link.sock} if self._link is not None and not self._link.closed else {}

    def start(self, fingerprint: str, kv_blocks: int = 0) -> None:
        """Say this rank has loaded `fingerprint` and holds `kv_blocks` KV blocks, then wait for START
        (the leader waits for every rank). Raises HandshakeError, with the leader's reason if it refused."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            self._send(Kind.LOADED, wire.encode(Loaded(fingerprint, kv_blocks)))
            frame = self._link_or_raise().recv(deadline)
        except LinkTimeout:
            self.close()
            raise HandshakeError(f"rank {self.rank}: no START from the leader within {self.connect_timeout:.0f} s "
                                 "of loading") from None
        except (LinkClosed, LeaderLost) as e:
            self.close()
            raise HandshakeError(f"rank {self.rank}: the leader hung up before the cluster started ({e})") from None
        if frame.kind is Kind.REJECT:
            self.close()
            raise HandshakeError(f"leader rejected rank {self.rank}: {wire.decode_reason(frame.payload)}")
        if frame.kind is not Kind.START:
            self.close()
            raise ProtocolError(f"rank {self.rank}: expected START or REJECT, got {frame.kind.name}")
        wire.decode_empty(frame.payload, "START")

    def _dial(self, deadline: float, gone: Callable[[], str | None] | None = None) -> socket.socket:
        delay, last = 0.02, "no attempt made"
        while True:
            why = gone() if gone is not None else None
            if why is not None:
                raise HandshakeError(why)
            try:
                sock = socket.create_connection((self.leader_host, self.port), timeout=max(remaining(deadline), 0.05))
                tune(sock, max(self.timeout, 5.0))
                return sock
            except OSError as e:
                last = str(e)
            if remaining(deadline) == 0:
                raise HandshakeError(f"could not reach the leader at {self.leader_host}:{self.port}: {last}")
            time.sleep(min(delay, remaining(deadline)))
            delay = min(delay * 2, 0.5)

    @property
    def _leader(self) -> str:
        return f"{self.leader_host}:{self.port}"

    def recv(self, timeout: float | None = None) -> Frame:
        """Next PLAN, TOKENS, HEARTBEAT or SHUTDOWN frame. LeaderLost if nothing at all arrives within `timeout`."""
        wait = self.timeout if timeout is None else timeout
        try:
            frame = self._link_or_raise().recv(time.monotonic() + wait)
        except LinkTimeout:
            silence = f"rank {self.rank}: nothing from the leader for {wait:.1f} s (not even a heartbeat)"
            self.leave(silence)  # a leader that was only stopped reads this once resumed, not 'process died'
            raise LeaderLost(silence) from None
        except LinkClosed as e:
            raise LeaderLost(f"rank {self.rank}: {e}") from None
        if frame.kind is Kind.REJECT:
            self.close()
            raise LeaderLost(f"rank {self.rank}: leader aborted the cluster: {wire.decode_reason(frame.payload)}")
        if frame.kind not in (Kind.PLAN, Kind.TOKENS, Kind.HEARTBEAT, Kind.SHUTDOWN):
            raise ProtocolError(f"unexpected {frame.kind.name} frame after the handshake")
        return frame

    def next_plan(self, timeout: float | None = None) -> StepPlan | None:
        """The next plan, skipping heartbeats (each restarts the silence timer); None on SHUTDOWN."""
        frame = self._next(Kind.PLAN, "TOKENS frame with no plan waiting for its ids", timeout)
        return None if frame is None else wire.decode_plan(frame.payload)

    def next_ids(self, plan: StepPlan, timeout: float | None = None) -> tuple[int, ...] | None:
        """The input ids of `plan`, sent with `ids_follow` (one per chunk), skipping heartbeats; None on
        SHUTDOWN. Anything else (a plan, ids of another step or count) is a ProtocolError."""
        frame = self._next(Kind.TOKENS, f"a plan arrived before the ids of step {plan.step_id}", timeout)
        if frame is None:
            return None
        msg = wire.decode(Kind.TOKENS, frame.payload)
        if msg.step_id != plan.step_id or len(msg.ids) != len(plan.chunks):
            raise ProtocolError(f"rank {self.rank}: ids of step {msg.step_id} ({len(msg.ids)}) where "
                                f"step {plan.step_id} waits for {len(plan.chunks)}")
        return msg.ids

    def _next(self, kind: Kind, out_of_turn: str, timeout: float | None) -> Frame | None:
        """The next frame of `kind` (PLAN or TOKENS), skipping heartbeats; None on SHUTDOWN; the other of the
        two now is a ProtocolError saying `out_of_turn`."""
        while True:
            frame = self.recv(timeout)
            if frame.kind is kind:
                return frame
            if frame.kind in (Kind.PLAN, Kind.TOKENS):
                raise ProtocolError(f"rank {self.rank}: {out_of_turn}")
            if frame.kind is Kind.SHUTDOWN:
                self.shutdown_reason = wire.decode_reason(frame.payload)
                self.close()
                return None
            wire.decode_empty(frame.payload, "HEARTBEAT")
            self.heard_at = time.perf_counter()

    def ack(self, step_id: int, fingerprint: int, error: str = "", times: tuple[float, ...] = (),
            missing: tuple[bytes, ...] = (), sums: tuple[float, ...] = ()) -> None:
        """Report plan `step_id` applied (`error` non-empty: it failed, and this rank is about to exit);
        `times`: this rank's seconds by phase so far (meshlm/step_times.py); `missing`: keys of blocks the
        plan loads that this rank could not read; `sums`: its shared-memory sums so far (Ack.sums)."""
        self._send(Kind.ACK, wire.encode(Ack(step_id, fingerprint, error, tuple(times), tuple(missing),
                                             tuple(float(x) for x in sums))))

    def leave(self, reason: str) -> None:
        """Before this rank exits on its own: tell the leader why, best effort (it names the rank and the
        reason, not a connection closed as if the process had died)."""
        self._beating.set()
        try:
            with self._send_lock:
                self._link_or_raise().send(wire.encode_reject(self._seq, reason), min(self.timeout, 1.0))
        except (ControlError, LinkClosed):
            pass

    def beat(self, interval: float) -> None:
        """Once started: a thread of its own tells the leader this rank is alive whenever `interval` s pass
        without a frame to it, also while this rank's step runs for long (a big model's prefill); so the
        leader finds a stopped or hung rank within its silence timeout, not at the step's deadline. It
        ends with the connection, quietly: the main thread meets and reports a lost leader."""
        def run() -> None:
            while not self._beating.wait(interval / 4):
                if time.monotonic() - self._last_send < interval:
                    continue
                try:
                    self._send(Kind.HEARTBEAT, b"")
                except ControlError:
                    return

        threading.Thread(target=run, name=f"meshlm-heartbeat-{self.rank}", daemon=True).start()

    def _send(self, kind: Kind, payload: bytes) -> None:
        with self._send_lock:
            data = wire.encode_frame(kind, self._seq, payload, max_payload=self.max_payload)
            try:
                self._link_or_raise().send(data, self.timeout)
            except LinkClosed as e:
                raise LeaderLost(f"rank {self.rank}: {e}") from None
            self._seq += 1
            self._last_send = time.monotonic()

    def _link_or_raise(self) -> Link:
        if self._link is None or self._link.closed:
            raise LeaderLost(f"rank {self.rank}: not connected")
        return self._link

    def close(self) -> None:
        self._beating.set()
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> ControlWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
