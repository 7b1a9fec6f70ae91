"""A worker rank: apply every StepPlan the leader sends, in lockstep, and acknowledge it.

Workers decide nothing. They exit when the leader says SHUTDOWN (0), when the
leader goes silent past --worker-timeout (3), when a plan cannot be applied
(4, after telling the leader why), or when a forward outlives --step-timeout
(the watchdog ends the process: a collective with a dead peer cannot be
interrupted from Python).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

import mlx.core as mx

from meshlm.cluster.bootstrap import ClusterError
from meshlm.cluster.watchdog import Watchdog
from meshlm.config import ParallelConfig, split_addr
from meshlm.engine.plan import batch_fingerprint
from meshlm.executor.rank import RankState
from meshlm.executor.stage_io import StageIO
from meshlm.transport.auth import ClusterSecret
from meshlm.transport.control import ControlError, ControlWorker, LeaderLost

log = logging.getLogger(__name__)

EXIT_SHUTDOWN, EXIT_LEADER_LOST, EXIT_STEP_FAILED, EXIT_DEADLINE = 0, 3, 4, 5
LEADER_GONE_GRACE = 1.0  # seconds a hung-up leader connection must last inside one step
# A local worker given SIGINT/SIGTERM waits this long for rank 0 to stop it (rank 0 drains for up to 2 s).
FOLLOW_SECONDS = 15.0


def _hard_exit(message: str, code: int = EXIT_DEADLINE) -> None:
    log.error("rank exiting: %s", message)
    os._exit(code)


def _leader_gone_probe(control: ControlWorker, watchdog: Watchdog, rank: int) -> Callable[[], None]:
    """The step watchdog's probe on a worker: a leader whose connection closed while this rank is inside a
    step ends the rank within about a second. Between steps the plan reader sees the hang-up itself; inside
    one, the rank may wait in a collective whose peer died (the ring backend's sends fail, and its wait
    stayed until the step's deadline: 60 s after the leader was killed, with a word about a deadline).
    A hang-up must last LEADER_GONE_GRACE inside one step: a leader that finished cleanly closes right
    after its SHUTDOWN, which the plan reader takes once the step ends."""
    first_seen: dict[str, float] = {}

    def probe() -> None:
        step = watchdog.current_step
        if step is None or not control.leader_hung_up():
            first_seen.clear()
            return
        since = first_seen.setdefault(step, time.monotonic())
        if time.monotonic() - since >= LEADER_GONE_GRACE:
            _hard_exit(f"rank {rank}: the leader's connection closed during {step} (its process died, or its "
                       "host reset the connection)", EXIT_LEADER_LOST)

    return probe


def answer_roll_call(cfg: ParallelConfig, secret: ClusterSecret, start_timeout: float,
                     gone: Callable[[], str | None] | None = None) -> ControlWorker:
    """Join the leader's control channel before loading anything, so a rank that dies while loading is
    noticed at once. `start_timeout`: how long to try, and later to wait for the start once loaded;
    `gone`: why the leader will never listen (a local rank 0 that died)."""
    host, port = split_addr(cfg.control_addr)
    control = ControlWorker(host, int(port), cfg.rank, timeout=cfg.worker_timeout, world_size=cfg.world_size,
                            secret=secret, connect_timeout=max(start_timeout, cfg.worker_timeout))
    try:
        control.connect(gone)
    except ControlError as exc:  # refused, wrong version, no leader: the message says what to fix
        raise ClusterError(str(exc)) from None
    log.info("rank %d answered the leader's roll call at %s", cfg.rank, cfg.control_addr)
    return control


def run_worker(cfg: ParallelConfig, control: ControlWorker, rank: RankState, fingerprint: str,
               join_stages: Callable[[], StageIO] | None = None, on_joined: Callable[[], None] | None = None,
               local: bool = False, sums=None) -> int:
    """Say this rank has loaded, wait for the start, then serve plans until the cluster ends.
    `join_stages`: a pipeline stage's links to its neighbours, formed once the cluster has started;
    `on_joined`: called once it has (joining the shared-memory sums, whose file the leader makes before
    it starts the cluster); `local`: rank 0 started this process (`_leave_stopping_to_rank_0`); `sums`: the
    SharedMemoryGroup this rank's layers sum over, whose counts its acks carry (None: MLX's backend)."""
    try:
        control.start(fingerprint, rank.max_blocks)
    except ControlError as exc:  # another model, or the leader gave up: the message says what to fix
        raise ClusterError(str(exc)) from None
    log.info("rank %d started by the leader at %s", cfg.rank, cfg.control_addr)
    control.beat(cfg.heartbeat_interval)
    if local:
        _leave_stopping_to_rank_0(cfg.rank, control)
    io = None
    try:
        if on_joined is not None:
            on_joined()
        io = join_stages() if join_stages is not None else None
    except (ControlError, RuntimeError) as exc:
        control.close()
        raise ClusterError(str(exc)) from None
    def expire(message: str) -> None:
        # Told first, the leader names the deadline: its own may fire later (its step began later), and it
        # saw only "connection reset by peer" when this rank had exited before (helper-60)
        control.leave(f"rank {cfg.rank}: {message}")
        _hard_exit(message)

    watchdog = Watchdog(cfg.step_timeout, expire, name=f"meshlm-watchdog-{cfg.rank}")
    watchdog.probe = _leader_gone_probe(control, watchdog, cfg.rank)
    try:
        return _serve_plans(control, rank, watchdog, io, sums)
    finally:
        watchdog.close()
        control.close()
        if io is not None:
            io.close()
        rank.flush(timeout=2)


def _leave_stopping_to_rank_0(rank: int, control: ControlWorker) -> None:
    """A worker that rank 0 started shares its process group, so the terminal's Ctrl-C (or a service
    manager's SIGTERM to the group) reaches every rank at once. Rank 0 then drains and stops its ranks
    itself; a worker that ended at the signal made that orderly stop a failure (rank 0: 'worker rank 1
    lost', status 70, and the worker's KeyboardInterrupt traceback). Here the signal only arms a
    deadline: were rank 0 hung, or the signal this worker's alone, the worker still ends FOLLOW_SECONDS
    later, telling rank 0 why. (Before the cluster has started, the default actions stand: the join
    watcher and the start's own checks rely on them.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    armed: list[int] = []

    def on_signal(sig: int, _frame) -> None:
        if armed:
            return
        armed.append(sig)
        name = signal.Signals(sig).name
        log.info("rank %d: %s: rank 0 stops the cluster when the signal reached it too (a signal to the process "
                 "group); else this rank ends by itself within %.0f s, and the cluster with it", rank, name,
                 FOLLOW_SECONDS)

        def leave() -> None:
            control.leave(f"rank {rank} got {name}, and rank 0 had not stopped the cluster {FOLLOW_SECONDS:.0f} s "
                          "later (the signal was this rank's alone)")
            os._exit(128 + sig)

        timer = threading.Timer(FOLLOW_SECONDS, leave)
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _serve_plans(control: ControlWorker, rank: RankState, watchdog: Watchdog, io: StageIO | None = None,
                 sums=None) -> int:
    times = rank.times
    while True:
        try:
            asked = time.perf_counter()
            plan = control.next_plan()
            # An idle leader heartbeats, and sends one more before the plan that ends its idling: only the
            # time since is waiting for the leader's step work (an idle cluster's hours were counted here).
            times.add("wait", time.perf_counter() - max(asked, control.heard_at))
        except LeaderLost as exc:
            log.error("%s; exiting", exc)
            return EXIT_LEADER_LOST
        except ControlError as exc:  # a frame this rank cannot take: the stream is not to be trusted after it
            log.error("the leader's control channel sent what this rank cannot take: %s; exiting", exc)
            return EXIT_STEP_FAILED
        if plan is None:
            log.info("leader asked to stop: %s", control.shutdown_reason)
            return EXIT_SHUTDOWN
        try:
            with watchdog.step(f"step {plan.step_id}"):
                prepared = rank.prepare(plan)  # a later pipeline stage: while the activation is on its way
                tokens = None
                if plan.ids_follow:  # planned before its ids were sampled: they follow in a TOKENS frame
                    with times.timing("wait"):
                        ids = control.next_ids(plan)
                    if ids is None:
                        log.info("leader asked to stop: %s", control.shutdown_reason)
                        return EXIT_SHUTDOWN
                    tokens = rank.runner.follow_ids(plan, ids)
                with times.timing("link"):
                    hidden = io.receive(plan) if io is not None else None
                result = rank.launch(prepared, hidden, tokens)
                if io is not None:
                    if result.hidden is not None:
                        # The launch returns with ~100 ops still queued (the runner's launch): a stage's
                        # forward would end inside the send, its time counted as the link's
                        with times.timing("device"):
                            mx.eval(result.hidden)
                    with times.timing("link"):
                        io.send(plan, result)
                elif result.logits is not None:
                    with times.timing("device"):
                        mx.eval(result.logits)  # every rank must take part in the step's collectives
        except LeaderLost as exc:  # waiting for a plan's ids
            log.error("%s; exiting", exc)
            return EXIT_LEADER_LOST
        except Exception as exc:  # the group is unusable after a failed step: report, then leave
            log.exception("step %d failed", plan.step_id)
            try:
                control.ack(plan.step_id, 0, error=f"{type(exc).__name__}: {exc}")
            except LeaderLost:
                pass
            return EXIT_STEP_FAILED
        try:
            with times.timing("control"):
                control.ack(plan.step_id, batch_fingerprint(rank.runner.lengths), times=times.totals(),
                            missing=result.missing, sums=sums.stats() if sums is not None else ())
        except LeaderLost as exc:  # e.g. this rank was stopped past the leader's patience, then continued
            log.error("%s; exiting", exc)
            return EXIT_LEADER_LOST
