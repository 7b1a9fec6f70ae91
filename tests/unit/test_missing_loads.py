"""The leader's check of a plan's loads (TensorExecutor.missing_loads): every rank's report is gathered
before the plan's results are sampled, and a worker's ACK naming a block the plan never loaded is a
protocol error, as any value a peer sends that does not fit what was asked."""

from __future__ import annotations

import pytest

from meshlm.engine.plan import BlockLoad, StepPlan
from meshlm.executor.tensor import TensorExecutor
from meshlm.model.runner import StepResult
from meshlm.step_times import StepTimes
from meshlm.transport.codec import Ack, ProtocolError

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
PLAN = StepPlan(7, loads=(BlockLoad(A, 0), BlockLoad(B, 1)), num_blocks=2)


class Rank:
    times = StepTimes()


class Control:
    def __init__(self, acks: dict[int, Ack]) -> None:
        self.acks, self.asked = acks, []

    def collect_acks(self, step_id: int, timeout: float | None = None) -> dict[int, Ack]:
        self.asked.append(step_id)
        return self.acks


def executor(acks: dict[int, Ack]) -> TensorExecutor:
    ex = TensorExecutor(Rank(), Control(acks), step_timeout=5.0)
    ex._unacked.append(PLAN.step_id)  # announced
    return ex


def test_every_ranks_missing_blocks_are_gathered_and_the_plan_counts_as_acked():
    ex = executor({1: Ack(7, 0, missing=(B,)), 2: Ack(7, 0)})
    assert ex.missing_loads(PLAN, StepResult([], None, missing=(A,))) == {A, B}
    assert ex.control.asked == [7] and not ex._unacked  # the next step does not wait for them again
    assert executor({1: Ack(7, 0)}).missing_loads(PLAN, StepResult([], None)) == frozenset()


def test_a_worker_naming_a_block_the_plan_does_not_load_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="rank 2 acked step 7 naming a block the plan does not load"):
        executor({1: Ack(7, 0, missing=(A,)), 2: Ack(7, 0, missing=(C,))}).missing_loads(PLAN, StepResult([], None))
