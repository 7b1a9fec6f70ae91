"""The leader's pipeline executor: the leader runs the last stage.

`submit(plan)` broadcasts a plan: every stage applies its table ops, stage 0
embeds the plan's tokens and starts at once. `execute(plan)` waits for that
plan's activation from the stage before the leader and runs the leader's
layers and the head, so logits never cross a link. The engine keeps up to
`depth` (= stages) plans submitted: while the leader computes micro-batch A,
stage 0 computes B. Plans reach every rank in one order and every rank applies
them in that order, so KV and the batch fingerprints stay consistent.

A worker acknowledges a plan right after sending its activation, so when the
leader executes the next plan those acks are in: it checks them then, before
waiting for that plan's activation, never on the way to submitting a plan.
Every stage after the first applies a plan (`Runner.prepare`) before its
activation arrives, and only then builds and launches the forward on it.
The control plane, failure diagnosis and shutdown are the tensor-parallel
executor's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshlm.engine.plan import StepPlan
from meshlm.executor.stage_io import StageIO
from meshlm.executor.tensor import TensorExecutor
from meshlm.model.runner import StepResult
from meshlm.transport.control import ControlError


class StageFailed(RuntimeError):
    """A pipeline rank failed on the control channel; the message names the stage it runs."""


class PipelineExecutor(TensorExecutor):
    def __init__(self, rank, control, step_timeout: float, io: StageIO, depth: int,
                 stages: dict[int, str] | None = None) -> None:
        super().__init__(rank, control, step_timeout)
        self.io = io
        self.depth = depth  # plans the engine keeps in flight (one micro-batch per stage)
        self.stages = stages or {}  # rank -> what it runs ("stage 0, layers 0..14"), for failure messages

    plans_ahead = False  # micro-batches overlap the stages instead (the engine's `_plan_ids_ahead`)

    def submit(self, plan: StepPlan) -> None:
        with self.times.timing("control"), self._naming_stages():
            self.wake_workers()
            self.control.broadcast(plan)

    def send_ids(self, step_id: int, ids: list[int]) -> None:
        """The sampled input ids of plan `step_id`, submitted with `ids_follow` before they were known."""
        with self.times.timing("control"), self._naming_stages():
            self.control.send_ids(step_id, ids)

    @contextlib.contextmanager
    def _naming_stages(self) -> Iterator[None]:
        """A control-channel failure names the stage of the rank it names at once: requests end with this
        message and /health shows it until the executor's reset has diagnosed the failure."""
        try:
            yield
        except ControlError as exc:
            what = self.stages.get(getattr(exc, "rank", None))
            if what is None:
                raise
            raise StageFailed(f"{type(exc).__name__}: {exc} [rank {exc.rank} runs {what}]") from exc

    def missing_loads(self, plan: StepPlan, result: StepResult) -> frozenset[bytes]:
        with self._naming_stages():  # a stage's ack arrives right after its activation did
            return super().missing_loads(plan, result)

    def known_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, StageFailed) or super().known_failure(exc)  # a stage link's errors are ControlErrors

    def execute(self, plan: StepPlan) -> StepResult:
        # The leader's stage would idle until the activation arrives: the acks of the plan before and the
        # part of the step that needs only the plan are done first, off the path from the activation to
        # the logits (with one stream, every stage waits on that path for the others).
        with self.times.timing("control"), self._naming_stages():
            self._collect_acks()
            self._unacked.append(plan.step_id)
        prepared = self.rank.prepare(plan)
        with self.times.timing("link"):
            hidden = self.io.receive(plan)
        return self.rank.launch(prepared, hidden)

    def _diagnose(self, error: str, wait: float = 1.0) -> str:
        """The tensor-parallel diagnosis, plus which stage each rank it names runs."""
        message = super()._diagnose(error, wait)
        named = [f"rank {r} runs {what}" for r, what in sorted(self.stages.items())
                 if f"rank {r}" in message and f"rank {r} runs" not in message]
        return f"{message} [{'; '.join(named)}]" if named else message

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.io.close()
