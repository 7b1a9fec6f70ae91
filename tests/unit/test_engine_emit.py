"""What the engine streams for a sequence's runs of tokens (one token, or an accepted speculative run) and
when it ends: the text a stop string holds back, the token a run ends on, what usage counts. A one-byte
tokenizer (id = character code, 0 = EOS) makes each token's text plain."""

from __future__ import annotations

from meshlm.config import SchedulerConfig
from meshlm.engine.engine import Engine, _Pending
from meshlm.engine.request import FinishReason, SamplingParams, SeqStatus
from meshlm.engine.scheduler import Finished
from meshlm.kv.blocks import BlockManager
from meshlm.step_times import StepTimes

EOS = 0


class Chars:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)


class Idle:
    times = StepTimes()


def generate(runs: list[str], end: str = "eos", **params) -> tuple[str, int, FinishReason | None]:
    """Stream `runs` (each a run of tokens taken in one step) for one sequence; the last run ends with EOS
    (`end` "eos", the scheduler's STOP) or nothing. Returns the text shown, usage's completion tokens and
    the finish reason."""
    engine = Engine(Idle(), Chars(), SchedulerConfig(), 512, lambda: BlockManager(8, 4), frozenset({EOS}))
    outputs = []
    uid = engine.submit([65, 66], SamplingParams(max_tokens=100, temperature=0, **params), outputs.append)
    seq = next(s for s in engine.scheduler.waiting if s.uid == uid)
    for i, run in enumerate(runs):
        tokens = [ord(c) for c in run] + ([EOS] if i == len(runs) - 1 and end == "eos" else [])
        finished = []
        stop = next((j for j, t in enumerate(tokens) if t == EOS or t in seq.params.stop_token_ids), None)
        if stop is not None:  # what the scheduler's update does with a stop token: the run ends on it
            tokens = tokens[: stop + 1]
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.STOP
            finished = [Finished(seq, FinishReason.STOP)]
        seq.output_ids.extend(tokens)
        engine._emit(_Pending({uid: tokens}, {}, finished))
        if finished:
            break
    return "".join(o.text for o in outputs), outputs[-1].completion_tokens, outputs[-1].finish_reason


def test_text_held_back_for_a_stop_string_is_shown_when_eos_ends_the_sequence():
    """Regression: "Paris." with stop ["..."] ended "Paris": the "." held back as the stop string's possible
    start was dropped when EOS ended the sequence (vLLM holds nothing back once finished)."""
    assert generate(list("Paris."), stop=("...",)) == ("Paris.", 7, FinishReason.STOP)
    assert generate(list("Paris. The"), stop=("Paris. Then",)) == ("Paris. The", 11, FinishReason.STOP)


def test_tokens_after_a_stop_string_in_a_run_that_ends_on_eos_are_not_counted():
    """Regression (speculation): an accepted run holding a stop string and ending on EOS counted every
    token of the run in usage, though those after the stop string were never shown."""
    assert generate(["the", " dog ran."], stop=("dog",)) == ("the ", 7, FinishReason.STOP)
    assert generate(["the", " dog ran."], end="none", stop=("dog",)) == ("the ", 7, FinishReason.STOP)


def test_the_stop_token_is_shown_only_with_include_stop_str_in_output():
    dot = ord(".")
    assert generate(["Paris."], end="none", stop_token_ids=(dot,)) == ("Paris", 6, FinishReason.STOP)
    assert generate(["Paris."], end="none", stop_token_ids=(dot,), include_stop_str=True) == \
        ("Paris.", 6, FinishReason.STOP)
    assert generate(["Paris"], include_stop_str=True) == ("Paris", 6, FinishReason.STOP)  # EOS decodes to ""


def test_a_request_whose_sequences_do_not_all_fit_the_queue_queues_none():
    """Regression: n choices were queued one by one; the one that found the queue full made the request a
    429, and the ones queued before it were aborted: /metrics counted an aborted request and its prompt
    tokens for a request the client was refused."""
    import pytest

    from meshlm.engine.scheduler import QueueFull

    engine = Engine(Idle(), Chars(), SchedulerConfig(max_waiting=3), 512, lambda: BlockManager(8, 4), frozenset({EOS}))
    params = SamplingParams(max_tokens=4)
    engine.submit([65, 66], params, lambda o: None)
    with pytest.raises(QueueFull, match="needs 3 places"):
        engine.submit_all([([65, 66, 67], params, lambda o: None)] * 3)
    assert len(engine.scheduler.waiting) == 1 and len(engine._tracked) == 1
    assert engine.metrics.prompt_tokens._value.get() == 2
    assert len(engine.submit_all([([65], params, lambda o: None)] * 2)) == 2  # exactly the room left
