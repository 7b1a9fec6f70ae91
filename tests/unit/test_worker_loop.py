"""A worker rank's loop over the leader's plans (executor/worker.py) ends with an exit code saying why, for
every way the control channel can fail: a frame it cannot take was an uncaught exception (a traceback and
an unexplained exit) where a lost leader and a stop request had their codes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshlm.executor import worker
from meshlm.step_times import StepTimes
from meshlm.transport.codec import ProtocolError
from meshlm.transport.control import LeaderLost


class _Control:
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
