"""The leader's pipeline executor: the leader runs the last stage. Per step it broadcasts the plan
(every stage applies its table ops, stage 0 embeds the plan's tokens), waits for the activation of the
stage before it, and runs its own layers and the head, so logits never cross a link.

One plan is in flight at a time here; the control plane, acks, failure diagnosis and shutdown are the
tensor-parallel executor's.
"""

from __future__ import annotations

import time

from meshlm.engine.plan import StepPlan
from meshlm.executor.stage_io import StageIO
from meshlm.executor.tensor import TensorExecutor
from meshlm.model.runner import StepResult


class PipelineExecutor(TensorExecutor):
    def __init__(self, rank, control, step_timeout: float, io: StageIO) -> None:
        super().__init__(rank, control, step_timeout)
        self.io = io
        self.wait_seconds = 0.0  # time spent waiting for the previous stage (benchmarks report it)

    def execute(self, plan: StepPlan) -> StepResult:
        self.announce(plan)
        t0 = time.perf_counter()
        hidden = self.io.receive(plan)
        self.wait_seconds += time.perf_counter() - t0
        return self.rank.step(plan, hidden)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.io.close()
