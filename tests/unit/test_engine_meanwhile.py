"""Where the engine streams the last step's tokens relative to the next step's launch. A cluster's leader on
MLX's CPU stream returns from a launch only near the forward's end, so it streams between sending the
workers the plan and building its own share (`host_work_meanwhile`); any other executor streams after the
launch, while the forward runs (the GPU's path). Both orders must stream the same tokens and end the same
way. A one-byte tokenizer (id = character code) and an executor that records what happens when: its
logits make every row's greedy token the next letter of a fixed text."""

from __future__ import annotations

import mlx.core as mx
import pytest

from meshlm.config import SchedulerConfig
from meshlm.engine.engine import Engine
from meshlm.engine.request import FinishReason, SamplingParams
from meshlm.kv.blocks import BlockManager
from meshlm.model.runner import StepResult
from meshlm.step_times import StepTimes

VOCAB = 128
TEXT = "Paris is the capital"


class Chars:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class RecordingExecutor:
    """Logs each step's announce and launch, and the engine's outputs in between, in the order they happen."""

    def __init__(self, meanwhile: bool, events: list[tuple[str, int]]) -> None:
        self.times = StepTimes()
        self.host_work_meanwhile = meanwhile
        self.events = events
        self.lengths: dict[int, int] = {}

    def execute(self, plan, tokens=None, meanwhile=None) -> StepResult:
        assert tokens is None
        assert meanwhile is None or self.host_work_meanwhile, "host work handed to an executor that did not ask"
        self.events.append(("announce", plan.step_id))
        if meanwhile is not None:
            meanwhile()
        self.events.append(("launch", plan.step_id))
        rows, logits = [], []
        for c in plan.chunks:
            self.lengths[c.uid] = c.start + len(c.token_ids)
            if c.sample:
                rows.append(c.uid)
                generated = self.lengths[c.uid] - 2  # the prompt is two tokens
                row = [0.0] * VOCAB
                row[ord(TEXT[generated % len(TEXT)])] = 10.0
                logits.append(row)
        return StepResult(rows, mx.array(logits) if rows else None)

    def kv_bytes(self) -> int:
        return 0


def serve(meanwhile: bool, **params) -> tuple[list[tuple[str, int]], str, FinishReason | None]:
    events: list[tuple[str, int]] = []
    engine = Engine(RecordingExecutor(meanwhile, events), Chars(), SchedulerConfig(), 512,
                    lambda: BlockManager(16, 4), frozenset())
    outputs = []

    def emit(out) -> None:
        outputs.append(out)
        if out.text:
            events.append(("emit", len(outputs)))

    engine.submit([65, 66], SamplingParams(max_tokens=20, temperature=0, **params), emit)
    carry = None
    for _ in range(40):
        carry = engine._step(carry)
        if outputs and outputs[-1].finish_reason is not None:
            break
    assert outputs and outputs[-1].finish_reason is not None, "the sequence never ended"
    return events, "".join(o.text for o in outputs), outputs[-1].finish_reason


@pytest.mark.parametrize("params", [{}, {"stop": ("capital",)}, {"stop": ("is",)}, {"stop": (" the",)}])
def test_both_orders_stream_the_same_text_and_end_the_same_way(params):
    _, text, reason = serve(False, **params)
    assert serve(True, **params)[1:] == (text, reason)
    stop = "".join(params.get("stop", ()))
    assert (text, reason) == {"": (TEXT, FinishReason.LENGTH), "capital": ("Paris is the ", FinishReason.STOP),
                              "is": ("Par", FinishReason.STOP), " the": ("Paris is", FinishReason.STOP)}[stop]


def preceding(events: list[tuple[str, int]]) -> list[str]:
    """For each output, the step event it follows (announce: streamed before that step's launch)."""
    out = []
    for i, (kind, _) in enumerate(events):
        if kind == "emit":
            out.append(next(k for k, _ in reversed(events[:i]) if k != "emit"))
    return out


def test_a_cluster_on_the_cpu_streams_between_the_broadcast_and_its_own_launch():
    after = preceding(serve(True)[0])
    # Every step's tokens but the last's go out before the next launch; the last step has no next one.
    assert after[:-1] and set(after[:-1]) == {"announce"}, after


def test_elsewhere_the_tokens_stream_after_the_launch():
    after = preceding(serve(False)[0])
    assert after and set(after) == {"launch"}, after
