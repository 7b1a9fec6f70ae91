"""Ending a process whose threads may still be inside MLX."""

from __future__ import annotations

import logging
import os
import sys


def end_process(code: int) -> None:
    """Exit with `code` without interpreter teardown. After a peer died, a thread can still sit in a
    collective (or be failing its pending tasks); MLX's distributed backend does not survive its static
    destructors running under it, and the process then dies by a signal (SIGFPE seen in CI) instead of
    telling its supervisor `code`. Logs and stdio are flushed first, so nothing said is lost."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
