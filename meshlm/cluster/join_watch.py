"""Ends a rank stuck in the MLX group's join, or in a sharded load's collective, once a rank it waits
for is gone.

`mx.distributed.init` cannot be interrupted and holds the GIL while it waits, so no thread of the
joining process can notice that a peer died meanwhile (its ring port was taken, it crashed, it was
killed): faulthandler's deadline (180 s, then a stack dump) was the only way out. A tensor-parallel
load ends in a collective over the ring, which waits for ever for a host that vanished (no FIN, and
MLX's sockets send no keepalives). The control connections opened at the roll call stay open through
both, a rank that exits closes its end, and their keepalives (link.tune) fail within seconds when its
host vanishes. A small child process (`main` below, started by `JoinWatch`) polls them. The first to
close or fail ends the waiting rank: the child says which rank is gone, removes what the rank would
have removed, and sends it SIGTERM (nothing that needs a drain has started). Ctrl-C, which reaches the
child too, ends the rank the same way unless the rank ends first: in the join it would only see it
once the join returned. When the watched part ends, `JoinWatch` says so on the child's pipe and closes
it, and the child exits; so does a child whose rank died, as the pipe closes with it unsaid, after
removing what the rank would have (its join's deadline ends it with `os._exit`, so does a kill).

The child starts with Ctrl-C ignored and takes it only once it watches, and `JoinWatch` enters the join
only then: a Ctrl-C while the child's interpreter started once killed it with a traceback, and left
every rank of a local cluster in the join until faulthandler's deadline.

The child holds copies of the watched sockets, so it must not outlive the join: a peer would not see
this rank hang up while it did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# A rank whose own collective fails at once (or that hears Ctrl-C) ends itself within this. 1 s was once
# too short for a rank that heard Ctrl-C on a loaded 2-core VM (the CI): it was SIGTERMed on its way out.
NOTICE_GRACE_SECONDS = 2.0
KILL_GRACE_SECONDS = 2.0  # after SIGTERM, before SIGKILL (a rank that ignores SIGTERM)
READY_SECONDS = 10.0  # for the child to start watching; past it the rank goes on without waiting longer
DONE = b"k"


class JoinWatch:
    """`with JoinWatch(rank, {peer_rank: control_socket}, "joining", cleanup=[paths]): mx.distributed.init(...)`;
    `during` completes "rank r hung up while ..." in the message."""

    def __init__(self, rank: int, peers: dict[int, socket.socket], during: str,
                 cleanup: list[Path] | None = None) -> None:
        self.rank, self.peers, self.during, self.cleanup = rank, peers, during, cleanup or []
        self._child: subprocess.Popen | None = None
        self._done: int | None = None  # the write end of the child's pipe
        self._sigterm = None  # this rank's SIGTERM handler before the watched part, restored after it

    def __enter__(self) -> JoinWatch:
        if not self.peers:
            return self
        read, self._done = os.pipe()  # all ends non-inheritable: only `read` and `said` are passed on, below
        ready, said = os.pipe()
        fds = {peer: sock.fileno() for peer, sock in self.peers.items()}
        args = [str(os.getpid()), str(self.rank), str(read), str(said), self.during,
                *(f"{fd}:{peer}" for peer, fd in sorted(fds.items())),
                *(f"rm:{p}" for p in self.cleanup)]
        try:
            with _ctrl_c_ignored():  # inherited through exec: the child's start-up cannot die of a Ctrl-C
                self._child = subprocess.Popen([sys.executable, "-m", "meshlm.cluster.join_watch", *args],
                                               pass_fds=(read, said, *fds.values()), stdin=subprocess.DEVNULL)
        except OSError as exc:  # the join still ends at faulthandler's deadline
            log.warning("cannot watch the other ranks while %s (%s): a rank that dies meanwhile may be "
                        "noticed only at a deadline", self.during, exc)
            os.close(self._done)
            self._done = None
        finally:
            os.close(read)
            os.close(said)
        try:
            # Until the child watches, this rank still hears Ctrl-C itself: it waits here, not in the join.
            if self._child is not None and not select.select([ready], [], [], READY_SECONDS)[0]:
                log.warning("the watcher of the other ranks did not start within %.0f s; going on", READY_SECONDS)
        except BaseException:
            self.__exit__()
            raise
        finally:
            os.close(ready)
        # The child ends this rank with SIGTERM, which must act in the join, where no Python handler can run
        # (the CLI's, which makes it a Ctrl-C until serving begins, would wait for the join to return):
        # its default meanwhile.
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return self

    def __exit__(self, *exc) -> None:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self._done is not None:
            with contextlib.suppress(OSError):  # a child already gone
                os.write(self._done, DONE)  # what tells the child this rank got through, not died meanwhile
            os.close(self._done)
            self._done = None
        if self._child is not None:
            try:
                self._child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child = None


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile (only the main thread may change it; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: the handler was set outside Python, which can only be restored as the default
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def _gone(sock: socket.socket) -> str | None:
    """How the peer went: its end closed, or the connection failed; None when data waits instead."""
    try:
        return "hung up" if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"" else None
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        return f"was lost ({exc.strerror or exc}: its host may be down or unreachable)"


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
    """`PARENT RANK DONE_FD READY_FD DURING FD:PEER... [rm:PATH...]`, as `JoinWatch` passes them."""
    parent, rank, done, ready, during = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    socks = {int(fd): (int(peer), socket.socket(fileno=int(fd)))
             for fd, peer in (a.split(":", 1) for a in argv[5:] if not a.startswith("rm:"))}
    cleanup = [Path(a[3:]) for a in argv[5:] if a.startswith("rm:")]

    def stop(message: str) -> int:
        print(f"meshlm: {message}", file=sys.stderr, flush=True)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
        _stop(parent)
        return 0

    poller = select.poll()
    poller.register(done, select.POLLIN)  # readable at EOF: the watched part has ended, or the rank has died
    for fd in socks:
        poller.register(fd, select.POLLIN)
    # Ctrl-C reaches the whole process group; the rank, in the join, cannot act on it. It is taken as a
    # flag plus a byte on a pipe the poll watches, not as KeyboardInterrupt: that was raised wherever this
    # loop happened to be (once between `ready` and the poll, on a loaded CI machine: a traceback, and no
    # watcher), and a second Ctrl-C could cut the grace short.
    interrupted: list[int] = []
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGINT, lambda sig, _frame: interrupted.append(sig))  # started ignored (`_ctrl_c_ignored`)
    poller.register(wake_read, select.POLLIN)
    os.write(ready, b"r")
    os.close(ready)
    while True:
        if interrupted:
            if select.select([done], [], [], NOTICE_GRACE_SECONDS)[0]:
                return 0  # the rank heard it (it was not in the join yet, or no longer) and ended itself
            return stop(f"interrupted while {during}: rank {rank} stops")
        for fd, _ in poller.poll():
            if fd == wake_read:
                os.read(wake_read, 512)
                continue
            if fd == done:
                if os.read(done, 1) != DONE:  # closed unsaid: the rank died (faulthandler's join deadline, a kill)
                    # The deadline's stack dump names no rank, and a local cluster's ranks share one terminal.
                    print(f"meshlm: rank {rank} ended while {during}, before it got through (a stack dump above "
                          "is its deadline's; else it crashed or was killed)", file=sys.stderr, flush=True)
                    for path in cleanup:
                        shutil.rmtree(path, ignore_errors=True)
                return 0
            peer, sock = socks[fd]
            how = _gone(sock)
            if how is None:
                poller.unregister(fd)  # a frame already (a rank that has joined and loaded): not ours to read
                continue
            if select.select([done], [], [], NOTICE_GRACE_SECONDS)[0]:
                return 0  # the rank got past it (a collective that failed, and said why): nothing to add
            why = f" (rank {peer}'s own output says why)" if how == "hung up" else ""
            return stop(f"rank {peer} {how} while {during}, so the cluster cannot start: rank {rank} stops{why}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
