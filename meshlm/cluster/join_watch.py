"""Ends a rank stuck in the MLX group's join once a rank it waits for has hung up.

`mx.distributed.init` cannot be interrupted and holds the GIL while it waits, so no thread of the
joining process can notice that a peer died meanwhile (its ring port was taken, it crashed, it was
killed): faulthandler's deadline (180 s, then a stack dump) was the only way out. The control
connections opened at the roll call stay open through the join, and a rank that exits closes its end.
A small child process (`main` below, started by `JoinWatch`) polls them. The first to close ends the
joining rank: the child says which rank hung up, removes what the rank would have removed, and sends
it SIGTERM (nothing that needs a drain has started). When the join returns or fails, `JoinWatch` closes
the child's pipe and the child exits; so does a child whose rank died, as the pipe closes with it.

The child holds copies of the watched sockets, so it must not outlive the join: a peer would not see
this rank hang up while it did.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

KILL_GRACE_SECONDS = 2.0  # after SIGTERM, before SIGKILL (a rank that ignores SIGTERM)


class JoinWatch:
    """`with JoinWatch(rank, {peer_rank: control_socket}, cleanup=[paths]): mx.distributed.init(...)`."""

    def __init__(self, rank: int, peers: dict[int, socket.socket], cleanup: list[Path] | None = None) -> None:
        self.rank, self.peers, self.cleanup = rank, peers, cleanup or []
        self._child: subprocess.Popen | None = None
        self._done: int | None = None  # the write end of the child's pipe

    def __enter__(self) -> JoinWatch:
        if not self.peers:
            return self
        read, self._done = os.pipe()  # both ends non-inheritable: only `read` is passed on, below
        fds = {peer: sock.fileno() for peer, sock in self.peers.items()}
        args = [str(os.getpid()), str(self.rank), str(read), *(f"{fd}:{peer}" for peer, fd in sorted(fds.items())),
                *(f"rm:{p}" for p in self.cleanup)]
        try:
            self._child = subprocess.Popen([sys.executable, "-m", "meshlm.cluster.join_watch", *args],
                                           pass_fds=(read, *fds.values()), stdin=subprocess.DEVNULL)
        except OSError as exc:  # the join still ends at faulthandler's deadline
            log.warning("cannot watch the other ranks during the join (%s): a rank that dies meanwhile is "
                        "noticed only at the join's deadline", exc)
            os.close(self._done)
            self._done = None
        finally:
            os.close(read)
        return self

    def __exit__(self, *exc) -> None:
        if self._done is not None:
            os.close(self._done)
            self._done = None
        if self._child is not None:
            try:
                self._child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child = None


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed its end (or the connection failed); False when data waits instead."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _stop(parent: int) -> None:
    try:
        os.kill(parent, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        while time.monotonic() < deadline:
            os.kill(parent, 0)  # raises once it is gone (a zombie still counts until reaped)
            time.sleep(0.05)
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """`PARENT RANK DONE_FD FD:PEER... [rm:PATH...]`, as `JoinWatch` passes them."""
    parent, rank, done = int(argv[0]), int(argv[1]), int(argv[2])
    socks = {int(fd): (int(peer), socket.socket(fileno=int(fd)))
             for fd, peer in (a.split(":", 1) for a in argv[3:] if not a.startswith("rm:"))}
    cleanup = [Path(a[3:]) for a in argv[3:] if a.startswith("rm:")]
    poller = select.poll()
    poller.register(done, select.POLLIN)  # readable at EOF: the join has ended, or the rank has died
    for fd in socks:
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == done:
                return 0
            peer, sock = socks[fd]
            if not _hung_up(sock):
                poller.unregister(fd)  # a frame already (a rank that has joined and loaded): not ours to read
                continue
            print(f"meshlm: rank {peer} hung up while the ranks were joining the MLX group, so the group "
                  f"cannot form: rank {rank} stops (rank {peer}'s own output says why)", file=sys.stderr, flush=True)
            for path in cleanup:
                shutil.rmtree(path, ignore_errors=True)
            _stop(parent)
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
