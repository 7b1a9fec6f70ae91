"""The single-process executor: the whole model on this rank."""

from __future__ import annotations

from meshlm.engine.plan import StepPlan
from meshlm.executor.rank import RankState
from meshlm.model.runner import StepResult
from meshlm.step_times import StepTimes


class LocalExecutor:
    def __init__(self, rank: RankState) -> None:
        self.rank = rank

    def execute(self, plan: StepPlan) -> StepResult:
        return self.rank.step(plan)

    @property
    def times(self) -> StepTimes:
        return self.rank.times

    def rank_times(self) -> dict[int, tuple[float, ...]]:
        return {0: self.times.totals()}

    def kv_bytes(self) -> int:
        return self.rank.kv_bytes

    def idle(self) -> None:
        """Nothing to check between steps: no other ranks, and saved blocks go to the SSD writer at once."""

    def reset(self, error: str) -> str | None:
        self.rank.reset()
        return None

    def close(self) -> None:
        self.rank.flush(timeout=5)
