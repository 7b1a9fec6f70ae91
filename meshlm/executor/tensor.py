"""The leader's tensor-parallel executor: broadcast each plan, run rank 0's shard, check the workers.

Acks for step t are collected when step t+1 starts (by then every rank has
finished t's collectives), so the control plane adds one small send per step
to the critical path, not a round trip. A step planned ahead (the engine's
asynchronous scheduling) is broadcast while step t still runs, its input ids
to follow once sampled, before this rank launches the step that takes them;
t's acks are collected before t's tokens are streamed (`settle`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import mlx.core as mx

from meshlm.engine.plan import StepPlan
from meshlm.executor.rank import RankState
from meshlm.model.runner import StepResult
from meshlm.step_times import PHASES, StepTimes
from meshlm.transport.codec import ProtocolError
from meshlm.transport.control import ControlError, ControlLeader
from meshlm.transport.local_reduce import is_peer_lost

log = logging.getLogger(__name__)


class TensorExecutor:
    def __init__(self, rank: RankState, control: ControlLeader, step_timeout: float, sums=None) -> None:
        self.rank = rank
        self.control = control
        self.step_timeout = step_timeout
        self.sums = sums  # a SharedMemoryGroup the layers sum over, or None (the MLX group's)
        self._unacked: collections.deque[int] = collections.deque()  # plans broadcast, acks not collected
        self.failure: str | None = None
        self._stopped = False  # reset told the workers to stop
        # MLX's CPU stream returns from a launch only near the forward's end (runner `launch`), so host work
        # after it is serial with the step: the engine does it between the broadcast and this rank's build
        # instead, overlapping the workers' builds. A GPU's launch returns at once; work after it overlaps.
        self.host_work_meanwhile = mx.default_device() == mx.cpu
        self._idled = True  # the engine had nothing to run since the last plan (`wake_workers`)

    def execute(self, plan: StepPlan, tokens: mx.array | None = None,
                meanwhile: Callable[[], None] | None = None) -> StepResult:
        """Run `plan` on every rank. `tokens`: a decode plan planned ahead (`plans_ahead`), whose input ids
        the previous step is still sampling on this rank's device: the workers get them (`_send_ids`) before
        this rank launches the forward that takes them. `meanwhile`: host work to do once the workers have
        the plan, while they build their share of it (`host_work_meanwhile`)."""
        if tokens is not None and not plan.ids_follow:
            raise ValueError(f"step {plan.step_id}: planned ahead, so its ids must follow")
        self.announce(plan)
        if meanwhile is not None:
            meanwhile()
        if tokens is None:
            return self.rank.step(plan)
        return self.rank.step(plan, tokens=tokens, on_ids=lambda ids: self._send_ids(plan.step_id, ids))

    @property
    def plans_ahead(self) -> bool:
        """Takes a plan whose input ids are still being sampled (the engine's asynchronous scheduling); not
        under context parallelism, whose steps split their tokens over the ranks."""
        return self.rank.runner.ring is None

    def announce(self, plan: StepPlan) -> None:
        """Check the acks of the steps before, then send every worker this plan. A plan whose ids follow is
        sent while the step before it still runs: that step's acks are collected by `settle`."""
        with self.times.timing("control"):
            self._collect_acks(keep=1 if plan.ids_follow else 0)
            self.wake_workers()
            self.control.broadcast(plan)
            self._unacked.append(plan.step_id)
        self._remove_joined_file()

    def _send_ids(self, step_id: int, ids: list[int]) -> None:
        """The sampled input ids of plan `step_id` (broadcast with `ids_follow`), sent once this rank has
        them, before it launches the forward that takes them."""
        with self.times.timing("control"):
            self.control.send_ids(step_id, ids)

    def settle(self, keep: int = 0) -> None:
        """Check the acks of every plan broadcast but the newest `keep` (one planned ahead and still
        running): the engine streams a step's tokens only once every rank has confirmed the step."""
        with self.times.timing("control"):
            self._collect_acks(keep)

    def _collect_acks(self, keep: int = 0) -> None:
        """Wait for and check the acks of every plan broadcast but the newest `keep`."""
        if len(self._unacked) <= keep:
            return
        upto = self._unacked[-1 - keep]
        self.control.collect_acks(upto, timeout=self.step_timeout)
        while self._unacked and self._unacked[0] <= upto:
            self._unacked.popleft()

    def missing_loads(self, plan: StepPlan, result: StepResult) -> frozenset[bytes]:
        """Each rank reads the plan's loads from its own SSD tier, which evicts, expires and fails on its
        own: the plan's acks say which it could not read. They are collected now, before the plan's results
        are sampled (only plans with loads wait so; every rank's forward runs meanwhile)."""
        with self.times.timing("control"):
            acks = self.control.collect_acks(plan.step_id, timeout=self.step_timeout)
        while self._unacked and self._unacked[0] <= plan.step_id:
            self._unacked.popleft()
        loaded = {x.key for x in plan.loads}
        missing = set(result.missing)
        for rank, ack in acks.items():
            if not loaded.issuperset(ack.missing):
                raise ProtocolError(f"rank {rank} acked step {plan.step_id} naming a block the plan does not load")
            missing.update(ack.missing)
        return frozenset(missing)

    @property
    def times(self) -> StepTimes:
        return self.rank.times

    def rank_times(self) -> dict[int, tuple[float, ...]]:
        # Zeros for a worker that has not acked a step yet: its series exist from the start, so a dashboard
        # can tell a worker without traffic from no worker.
        zeros = {r: (0.0,) * len(PHASES) for r in range(1, self.control.world_size)}
        return {0: self.times.totals(), **zeros, **self.control.worker_times}

    def wake_workers(self) -> None:
        """Before the first plan after idling: a heartbeat, from which the workers count their wait for the
        plan (`meshlm_rank_seconds{phase="wait"}` is step time, not idle time)."""
        if self._idled:
            self._idled = False
            self.control.heartbeat()

    def idle(self) -> None:
        """Between steps with nothing to do: collect the last acks, heartbeat, notice dead workers."""
        self._idled = True
        self._collect_acks()
        self.control.maybe_heartbeat()
        self._remove_joined_file()

    def _remove_joined_file(self) -> None:
        # The workers map the shared-memory sums' file right after the handshake: a few polls later,
        # its name can go, so that no way this process ends (SIGKILL included) leaves it behind.
        if self.sums is not None:
            self.sums.remove_file(only_once_joined=True)

    def kv_bytes(self) -> int:
        return self.rank.kv_bytes

    def diagnose(self, error: str) -> str:
        """The first precise cause, found once: a collective failing ("peer lost") is a symptom, the
        control channel usually names the rank within ms."""
        if self.failure is None:
            self.failure = self._diagnose(error)
        return self.failure

    def reset(self, error: str) -> str | None:
        """A failed distributed step cannot be retried: the workers are told to stop."""
        if not self._stopped:
            self._stopped = True
            self.diagnose(error)
            self.abort_sums()
            try:
                self.control.shutdown(reason=f"leader failed: {self.failure}", linger=0.5)
            except Exception:  # best effort: the survivors also leave by their own timeouts
                log.exception("could not tell the workers to stop")
        return self.failure

    def known_failure(self, exc: BaseException) -> bool:
        """A rank lost: the control channel's errors, and a shared-memory sum whose peer is gone."""
        return isinstance(exc, ControlError) or is_peer_lost(exc)

    def _diagnose(self, error: str, wait: float = 1.0) -> str:
        deadline = time.monotonic() + wait
        while True:
            try:
                self.control.check_arrived_acks()
            except ControlError as exc:
                return f"{exc} ({error})" if str(exc) not in error else error
            if time.monotonic() >= deadline:
                return error
            time.sleep(0.05)

    def abort_sums(self) -> None:
        """No rank may stay asleep in a shared-memory sum that another will never join."""
        if self.sums is not None:
            self.sums.abort()

    def all_reduce_stats(self) -> dict[int, tuple[int, float, float]] | None:
        """Every rank's shared-memory sums, {rank: (count, seconds, seconds waiting for the others)}: rank
        0's own now, each worker's as of its last ack; None where the ranks sum with MLX's backend."""
        if self.sums is None:
            return None
        zeros = {r: (0, 0.0, 0.0) for r in range(1, self.control.world_size)}
        return {0: self.sums.stats(), **zeros, **self.control.worker_sums}

    def close(self) -> None:
        self.control.shutdown(reason="leader shutting down", linger=1.0)
        self.control.close()
        self.rank.flush(timeout=2)
        if self.sums is not None:
            self.sums.remove_file()
