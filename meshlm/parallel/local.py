"""The single-process executor: the whole model on this rank."""

from __future__ import annotations

import mlx.nn as nn

from meshlm.cache.prefix import PrefixCache
from meshlm.engine.plan import StepPlan
from meshlm.model.runner import Runner, StepResult


class LocalExecutor:
    def __init__(self, model: nn.Module, prefix_cache: PrefixCache | None = None, kv_budget_bytes: int = 0) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.kv_budget_bytes = kv_budget_bytes
        self.runner = Runner(model, prefix_cache)

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        if self.prefix_cache is not None:
            # Cached blocks get what running sequences leave of the KV budget.
            self.prefix_cache.pool.trim(self.kv_budget_bytes - self.runner.kv_bytes)
        return result

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def idle(self) -> None:
        pass

    def reset(self, error: str) -> str | None:
        self.runner = Runner(self.model, self.prefix_cache)
        return None

    def close(self) -> None:
        if self.prefix_cache is not None and self.prefix_cache.ssd is not None:
            self.prefix_cache.ssd.flush(timeout=5)
