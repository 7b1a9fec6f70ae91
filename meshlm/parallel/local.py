"""The single-process executor: the whole model on this rank."""

from __future__ import annotations

import mlx.nn as nn

from meshlm.engine.plan import StepPlan
from meshlm.model.runner import Runner, StepResult


class LocalExecutor:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.runner = Runner(model)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def reset(self) -> bool:
        self.runner = Runner(self.model)
        return True

    def close(self) -> None:
        pass
