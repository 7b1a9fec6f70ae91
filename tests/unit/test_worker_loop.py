"""A worker rank's loop over the leader's plans (executor/worker.py) ends with an exit code saying why, for
every way the control channel can fail: a frame it cannot take was an uncaught exception (a traceback and
an unexplained exit) where a lost leader and a stop request had their codes."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from meshlm.executor import worker
from meshlm.step_times import StepTimes
from meshlm.transport.codec import ProtocolError
from meshlm.transport.control import LeaderLost


class _Control:
    heard_at = 0.0  # no heartbeat heard (ControlWorker's)

    def __init__(self, exc: Exception | None) -> None:
        self.exc = exc
        self.shutdown_reason = "leader shutting down"

    def next_plan(self):
        if self.exc is not None:
            raise self.exc
        return None  # asked to stop


@pytest.mark.parametrize("exc, code", [
    (ProtocolError("a PLAN frame that does not decode"), worker.EXIT_STEP_FAILED),
    (LeaderLost("the leader's connection closed"), worker.EXIT_LEADER_LOST),
    (None, worker.EXIT_SHUTDOWN),
])
def test_each_way_the_plans_end_has_its_exit_code(exc, code, caplog):
    rank = SimpleNamespace(times=StepTimes())
    assert worker._serve_plans(_Control(exc), rank, watchdog=None) == code
    if isinstance(exc, ProtocolError):
        assert "cannot take: a PLAN frame that does not decode" in caplog.text


class _StepControl:
    """One plan with nothing to compute, whose ACK finds the leader gone."""

    shutdown_reason = ""
    heard_at = 0.0

    def __init__(self) -> None:
        self.plans = [SimpleNamespace(step_id=3, ids_follow=False)]

    def next_plan(self):
        return self.plans.pop() if self.plans else None

    def ack(self, step_id, fingerprint, **kwargs):
        raise LeaderLost("rank 1: send failed: [Errno 32] Broken pipe")


def test_a_leader_gone_by_the_steps_ack_is_a_lost_leader_not_a_traceback(caplog):
    """A rank stopped (SIGSTOP) past the leader's patience and continued finishes its step, then finds
    the leader's connection closed as it acknowledges it."""
    result = SimpleNamespace(logits=None, missing=())
    rank = SimpleNamespace(times=StepTimes(), prepare=lambda plan: plan, launch=lambda prepared, hidden, tokens: result,
                           runner=SimpleNamespace(lengths={}))
    watchdog = SimpleNamespace(step=lambda label: contextlib.nullcontext())
    assert worker._serve_plans(_StepControl(), rank, watchdog) == worker.EXIT_LEADER_LOST
    assert "Broken pipe; exiting" in caplog.text
