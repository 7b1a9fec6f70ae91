"""How an engine stops. One that cannot restart gives up once: a cluster's loss is seen by the engine
thread and the watchdog alike, and the second must not log, reset or ask the process to exit again.
A drain says whether it ended requests, so an idle server does not wait for their error events."""

from __future__ import annotations

from meshlm.config import SchedulerConfig
from meshlm.engine.engine import Engine
from meshlm.kv.blocks import BlockManager
from meshlm.step_times import StepTimes


class ClusterExecutor:
    """What a distributed executor does on reset: it cannot restart, and names the first cause."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self.resets: list[str] = []

    def diagnose(self, error: str) -> str:
        return error

    def reset(self, error: str) -> str:
        self.resets.append(error)
        return f"cluster failed: {self.resets[0]}"

    def known_failure(self, exc: BaseException) -> bool:
        return True

    def kv_bytes(self) -> int:
        return 0


def new_engine(executor, on_fatal=None) -> Engine:
    return Engine(executor, None, SchedulerConfig(), 64, lambda: BlockManager(8, 4), frozenset(), on_fatal=on_fatal)


def test_the_engine_and_the_watchdog_failing_it_give_up_once():
    executor, fatal = ClusterExecutor(), []
    engine = new_engine(executor, fatal.append)
    engine.fail("worker rank 1 lost: connection closed")
    engine.fail("worker rank 1 lost: missed its deadline")
    assert fatal == ["cluster failed: worker rank 1 lost: connection closed"]
    assert engine.problem == fatal[0]
    assert len(executor.resets) == 1


def test_an_idle_drain_ends_nothing_and_refuses_new_requests():
    engine = new_engine(ClusterExecutor())
    assert engine.drain(grace=5.0) is False
    assert engine.problem == "server shutting down"
