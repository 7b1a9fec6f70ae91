"""An engine that cannot restart gives up once: a cluster's loss is seen by the engine thread and the
watchdog alike, and the second must not log, reset or ask the process to exit a second time."""

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

    def reset(self, error: str) -> str:
        self.resets.append(error)
        return f"cluster failed: {self.resets[0]}"


def test_the_engine_and_the_watchdog_failing_it_give_up_once():
    executor, fatal = ClusterExecutor(), []
    engine = Engine(executor, None, SchedulerConfig(), 64, lambda: BlockManager(8, 4), frozenset(),
                    on_fatal=fatal.append)
    engine.fail("worker rank 1 lost: connection closed")
    engine.fail("worker rank 1 lost: missed its deadline")
    assert fatal == ["cluster failed: worker rank 1 lost: connection closed"]
    assert engine.problem == fatal[0]
    assert len(executor.resets) == 1
