"""The single-process executor: the whole model on this rank."""

from __future__ import annotations

import mlx.core as mx

from meshlm.engine.plan import StepPlan
from meshlm.executor.rank import RankState
from meshlm.model.runner import StepResult
from meshlm.step_times import StepTimes


class LocalExecutor:
    def __init__(self, rank: RankState) -> None:
        self.rank = rank

    def execute(self, plan: StepPlan, tokens: mx.array | None = None) -> StepResult:
        return self.rank.step(plan, tokens=tokens)

    def missing_loads(self, plan: StepPlan, result: StepResult) -> frozenset[bytes]:
        return frozenset(result.missing)

    @property
    def plans_ahead(self) -> bool:
        """Takes a decode plan whose input tokens are the previous step's samples, still on the device
        (the engine's asynchronous scheduling). Only here: a worker rank would need them before they are
        known, and a context-parallel step splits its tokens over ranks."""
        return self.rank.runner.ring is None

    @property
    def times(self) -> StepTimes:
        return self.rank.times

    def rank_times(self) -> dict[int, tuple[float, ...]]:
        return {0: self.times.totals()}

    def all_reduce_stats(self) -> None:
        return None

    def kv_bytes(self) -> int:
        return self.rank.kv_bytes

    def idle(self) -> None:
        """Nothing to check between steps: no other ranks, and saved blocks go to the SSD writer at once."""

    def diagnose(self, error: str) -> str:
        return error

    def reset(self, error: str) -> str | None:
        self.rank.reset()
        return None

    def known_failure(self, exc: BaseException) -> bool:
        return False  # one process: any failure of a step is a bug, traceback and all

    def close(self) -> None:
        self.rank.flush(timeout=5)
