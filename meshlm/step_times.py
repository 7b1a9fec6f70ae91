"""Where a rank's step time goes: cumulative seconds by phase, one object per rank.

A rank is never idle by design: every second it spends on a step is in one of these phases, so
a slow cluster shows which rank waits for what (benchmarks/scaling.py, `meshlm_rank_seconds`):

- `build`: building and launching a step's graph (the runner: plan checks, tables, the forward's
  Python);
- `device`: blocked until MLX has computed, the forward and its collectives together (a rank that
  waits in an all-reduce for a slower peer waits here);
- `schedule`, `sample`, `emit`: the leader's host work: choosing the next step's rows, sampling and
  updating the sequences, detokenising and streaming;
- `control`: the control plane (the leader's plan broadcast and ack checks, a worker's acks);
- `wait`: a worker waiting for its next plan (the leader's host work and the control plane, seen
  from a worker), not while the leader idles: it heartbeats then, and once more before the plan that
  ends its idling, and a worker counts only the time since the last heartbeat;
- `link`: a pipeline stage waiting for, or sending, activations.

Workers send their totals in every ACK (control protocol version 5), so the leader reports every
rank's breakdown without another message.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("build", "device", "schedule", "sample", "emit", "control", "wait", "link")


class StepTimes:
    """Seconds per phase since the rank started (monotonic clock)."""

    def __init__(self) -> None:
        self._seconds = [0.0] * len(PHASES)

    def add(self, phase: str, seconds: float) -> None:
        self._seconds[PHASES.index(phase)] += seconds

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def totals(self) -> tuple[float, ...]:
        """In PHASES order: what an ACK carries."""
        return tuple(self._seconds)


def check_totals(values: tuple[float, ...]) -> str | None:
    """Why a peer's totals (from an ACK) are not acceptable, or None."""
    if len(values) != len(PHASES):
        return f"{len(values)} phase times, expected {len(PHASES)}"
    if not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in values):
        return "a phase time that is not a finite number of seconds >= 0"
    return None
