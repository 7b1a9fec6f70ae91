"""A deadline on each step: a collective with a hung peer cannot time out by itself."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable

log = logging.getLogger(__name__)


class Watchdog:
    """Calls `on_expiry(message)` (from its own thread) when a step outlives `deadline` seconds,
    or when `probe()` (run every tick, e.g. a check that every rank's socket is open) raises."""

    def __init__(self, deadline: float, on_expiry: Callable[[str], None], name: str = "meshlm-watchdog",
                 probe: Callable[[], None] | None = None) -> None:
        self.deadline = deadline
        self.on_expiry = on_expiry
        self.probe = probe
        self._started: float | None = None
        self._label = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    @contextmanager
    def step(self, label: str):
        with self._lock:
            self._started, self._label = time.monotonic(), label
        try:
            yield
        finally:
            with self._lock:
                self._started = None

    @property
    def current_step(self) -> str | None:
        """The label of the step in progress, or None between steps."""
        with self._lock:
            return self._label if self._started is not None else None

    def _watch(self) -> None:
        while not self._stop.wait(min(0.5, self.deadline / 4)):
            with self._lock:
                started, label = self._started, self._label
            if started is not None and time.monotonic() - started > self.deadline:
                # A hung peer, or a step this machine needs longer for (a long prompt's chunk against a long
                # context): the message says which flags govern both
                self._expire(f"{label} outlived its {self.deadline:.0f} s deadline (--step-timeout: a rank "
                             f"hung, or the step was too large for it; --max-tokens-per-step bounds a step)")
            elif self.probe is not None:
                try:
                    self.probe()
                except Exception as exc:  # a dead rank noticed between or during steps
                    self._expire(str(exc))

    def _expire(self, message: str) -> None:
        self._stop.set()
        self.on_expiry(message)

    def close(self) -> None:
        self._stop.set()
