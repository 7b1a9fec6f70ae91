"""The outbox between the engine's thread and the event loop: order kept, one wake-up per held batch."""

from __future__ import annotations

import asyncio
import threading

from meshlm.api.outbox import Outbox


class CountingLoop:
    """Wraps a real loop, counting how often a thread wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakes = loop, 0

    def call_soon_threadsafe(self, callback, *args):
        self.wakes += 1
        return self.loop.call_soon_threadsafe(callback, *args)


async def _drain(queue: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(queue.get(), 5) for _ in range(n)]


def test_a_held_batch_from_another_thread_wakes_the_loop_once_and_keeps_order():
    async def main():
        loop = CountingLoop(asyncio.get_running_loop())
        outbox, a, b = Outbox(loop), asyncio.Queue(), asyncio.Queue()  # type: ignore[arg-type]

        def engine_step(step: int) -> None:
            with outbox.holding():
                for i in range(16):
                    outbox.put(a if i % 2 else b, (step, i))

        for step in range(3):
            t = threading.Thread(target=engine_step, args=(step,))
            t.start()
            t.join()
            got_a, got_b = await _drain(a, 8), await _drain(b, 8)
            assert got_a == [(step, i) for i in range(1, 16, 2)]
            assert got_b == [(step, i) for i in range(0, 16, 2)]
        assert loop.wakes == 3

    asyncio.run(main())


def test_puts_outside_a_batch_are_delivered_without_waiting_for_one():
    async def main():
        loop = CountingLoop(asyncio.get_running_loop())
        outbox, q = Outbox(loop), asyncio.Queue()  # type: ignore[arg-type]
        threading.Thread(target=outbox.put, args=(q, "abort")).start()
        assert await _drain(q, 1) == ["abort"]
        outbox.put(q, "again")  # the loop's own thread, after the first delivery: a new wake-up
        assert await _drain(q, 1) == ["again"]
        assert loop.wakes == 2

    asyncio.run(main())


def test_an_empty_batch_does_not_wake_the_loop_and_nested_batches_wake_once():
    async def main():
        loop = CountingLoop(asyncio.get_running_loop())
        outbox, q = Outbox(loop), asyncio.Queue()  # type: ignore[arg-type]
        with outbox.holding():
            pass
        assert loop.wakes == 0
        with outbox.holding():
            with outbox.holding():
                outbox.put(q, 1)
            outbox.put(q, 2)
            assert loop.wakes == 0
        assert await _drain(q, 2) == [1, 2]
        assert loop.wakes == 1

    asyncio.run(main())
