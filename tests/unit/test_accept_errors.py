"""The event loop's handler for refused accepts (api/connections.py, AcceptErrors)."""

from __future__ import annotations

import asyncio
import errno
import logging

from meshlm.api.connections import AcceptErrors


def refusal() -> dict:
    return {"message": "socket.accept() out of system resource", "exception": OSError(errno.EMFILE, "Too many open files")}


def test_refusals_are_one_line_then_counted_in_the_next(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = AcceptErrors(logging.getLogger("t"), every=30.0)
        with caplog.at_level(logging.WARNING, "t"):
            for _ in range(5):
                handler(loop, refusal())
        assert len(caplog.records) == 1 and "open-file limit" in caplog.records[0].getMessage()
        handler._last -= 31  # the next refusal after the period reports the four held back and itself
        with caplog.at_level(logging.WARNING, "t"):
            handler(loop, refusal())
        assert caplog.records[-1].getMessage().endswith("(refusals since the last report: 5)")
        assert not any(r.exc_info for r in caplog.records)
    finally:
        loop.close()


def test_other_errors_go_to_asyncios_handler(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = AcceptErrors(logging.getLogger("t"))
        with caplog.at_level(logging.ERROR, "asyncio"):
            handler(loop, {"message": "boom", "exception": RuntimeError("x")})
            handler(loop, {"message": "socket.accept() failed", "exception": OSError(errno.EBADF, "bad")})
        assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == ["boom", "socket.accept() failed"]
    finally:
        loop.close()
