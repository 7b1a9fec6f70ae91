"""Engine outputs on their way to the event loop: one wake-up per batch, not one per token.

The engine thread emits every running sequence's tokens once per step. Waking the event loop for each
(`call_soon_threadsafe` writes to its self-pipe) cost the engine thread ~4 % of a decode step at 16
streams; the outbox queues them and wakes the loop once for everything emitted before it runs.
"""

from __future__ import annotations

import asyncio
import threading


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item: object) -> None:
        """From any thread: `item` reaches `queue` on the loop, after everything put before it."""
        with self._lock:
            wake = not self._items
            self._items.append((queue, item))
        if wake:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)
