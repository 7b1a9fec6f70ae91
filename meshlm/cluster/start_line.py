"""Where the ranks of a local cluster meet before they join the MLX group.

MLX's join cannot be interrupted and holds the GIL while it waits: rank 0 waits in it for ever for a
rank that died before joining, and a rank that connects gives up after ~30 s if its peer has not yet
started listening (a loaded machine: CI once failed so, "[ring] Couldn't connect (error: 111)").
So the ranks of one machine first meet here, in the local cluster's directory, where waiting is plain
Python: each worker leaves a mark and waits for rank 0's word; rank 0 waits for every mark while
watching its children, then gives the word, and all join within milliseconds of each other. A rank
that exits or hangs first ends the start with an error that names it, not a silent wait.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from meshlm.cluster.bootstrap import ClusterError

POLL_S = 0.01


@dataclass(frozen=True)
class StartLine:
    directory: Path  # the local cluster's own (private) directory

    @classmethod
    def create(cls, directory: Path) -> "StartLine":
        """Rank 0's, before it starts any worker: its pid, which the workers' parent must be."""
        line = cls(directory)
        line._leader.write_text(str(os.getpid()))
        return line

    @property
    def _leader(self) -> Path:
        return self.directory / "leader"

    def _mark(self, rank: int) -> Path:
        return self.directory / f"ready-{rank}"

    @property
    def _word(self) -> Path:
        return self.directory / "go"

    def lead(self, children: Sequence[subprocess.Popen], timeout: float) -> None:
        """Rank 0: wait until every worker (rank r is children[r - 1]) is at the line, then give the word."""
        deadline = time.monotonic() + timeout
        waiting = set(range(1, len(children) + 1))
        while True:
            waiting = {r for r in waiting if not self._mark(r).exists()}
            why = exited(children)
            if why is not None:
                raise ClusterError(why)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"rank(s) {', '.join(map(str, sorted(waiting)))} did not reach the cluster's "
                                   f"start within {timeout:.0f} s")
            time.sleep(POLL_S)
        self._word.touch()

    def follow(self, rank: int, timeout: float) -> None:
        """A worker: leave this rank's mark, then wait for rank 0's word."""
        try:
            leader = int(self._leader.read_text())
        except (OSError, ValueError):
            raise ClusterError(f"no start line in {self.directory}: a local worker is started by rank 0") from None
        self._mark(rank).touch()
        deadline = time.monotonic() + timeout
        while not self._word.exists():
            if os.getppid() != leader:  # a dead parent's children are re-parented, even before we looked
                shutil.rmtree(self.directory, ignore_errors=True)  # rank 0 cannot remove it now
                raise ClusterError("rank 0 ended before the cluster formed")
            if time.monotonic() > deadline:
                raise ClusterError(f"rank 0 did not start the cluster within {timeout:.0f} s")
            time.sleep(POLL_S)


def exited(children: Sequence[subprocess.Popen]) -> str | None:
    """Why the cluster cannot form: the first local worker (rank r is children[r - 1]) that has exited."""
    for r, child in enumerate(children, start=1):
        code = child.poll()
        if code is not None:
            return f"rank {r} exited with status {code} before joining the cluster (its own output says why)"
    return None
