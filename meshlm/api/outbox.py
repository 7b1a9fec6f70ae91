"""Engine outputs on their way to the event loop: one wake-up per step, not one per token.

The engine thread emits every running sequence's tokens once per step. Waking the event loop for each
(`call_soon_threadsafe` writes to its self-pipe) cost the engine thread ~4 % of a decode step at 16
streams. Queuing them and waking the loop only when nothing was queued was not enough: the write to the
self-pipe releases the GIL, the loop thread takes it, drains the one item and so the next put wakes it
again (py-spy on a pinned pipeline leader: the self-pipe write was most of the engine's emit time). So
the engine holds the outbox while it emits a step (`holding`), and the loop is woken once at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterator


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._held = 0  # open `holding` scopes: puts queue without waking the loop
        self._woken = False  # a `_deliver` is scheduled and has not taken the items yet

    def put(self, queue: asyncio.Queue, item: object) -> None:
        """From any thread: `item` reaches `queue` on the loop, after everything put before it."""
        with self._lock:
            self._items.append((queue, item))
            wake = self._claim_wake()
        if wake:
            self._wake()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Puts made meanwhile (from any thread) reach the loop together, with one wake-up at the end."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                wake = self._claim_wake()
            if wake:
                self._wake()

    def _claim_wake(self) -> bool:
        """Under the lock: whether the caller must wake the loop now (and that it will)."""
        if self._held or self._woken or not self._items:
            return False
        self._woken = True
        return True

    def _wake(self) -> None:
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._woken = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)
