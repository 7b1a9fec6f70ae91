"""A pipeline stage's two neighbours: the activation it receives before its layers run and the one it
sends after. Both sides derive what to expect from the StepPlan every rank receives: a plan with token
chunks moves one activation of (1, tokens, hidden) down the pipeline, any other plan moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from meshlm.engine.plan import StepPlan
from meshlm.model.runner import StepResult
from meshlm.transport.stage_link import ActivationSpec, StageLink


@dataclass
class StageIO:
    stage: int
    prev: StageLink | None  # None on stage 0, which embeds the plan's token ids
    next: StageLink | None  # None on the last stage, which computes logits
    spec: ActivationSpec
    timeout: float  # per packet: a neighbour that is slower than this has failed

    def receive(self, plan: StepPlan) -> mx.array | None:
        if self.prev is None or not plan.chunks:
            return None
        return self.prev.recv_activation(plan.step_id, packet_pos(plan), plan.num_tokens, self.spec, self.timeout)

    def send(self, plan: StepPlan, result: StepResult) -> None:
        if self.next is None or result.hidden is None:
            return
        self.next.send_activation(plan.step_id, packet_pos(plan), result.hidden, self.timeout)

    def close(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.close()


def packet_pos(plan: StepPlan) -> int:
    """The header's `pos`: the position of the batch's first token (its first row's start)."""
    return plan.chunks[0].start if plan.chunks else 0
