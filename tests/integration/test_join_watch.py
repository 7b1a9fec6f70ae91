"""The join watcher (meshlm/cluster/join_watch.py) with real processes and sockets: a "rank" process holds a
control connection to this test, enters `JoinWatch` and then blocks, as `mx.distributed.init` does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


RANK = """
import signal, socket, sys, time
from pathlib import Path
from meshlm.cluster.join_watch import JoinWatch
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
try:
    with JoinWatch(1, {0: sock}, "the ranks joined", cleanup=[Path(sys.argv[2])]):
        if sys.argv[4] == "deaf":  # to Ctrl-C, as MLX's join is (it holds the GIL)
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("joining", flush=True)
        time.sleep(float(sys.argv[3]))  # the join
        if sys.argv[4] == "deaf":
            signal.signal(signal.SIGINT, previous)
except KeyboardInterrupt:
    print("the rank heard Ctrl-C", file=sys.stderr, flush=True)
    sys.exit(130)
print("joined", flush=True)
sys.stdin.read()  # the rest of the start: this test says when it ends
"""


def _rank(listener: socket.socket, tmp_path: Path, join_seconds: float, ears: str = "deaf"):
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(listener.getsockname()[1]), str(tmp_path / "ring"),
                             str(join_seconds), ears], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    conn, _ = listener.accept()
    assert proc.stdout.readline() == "joining\n"
    return proc, conn


def _end(proc: subprocess.Popen) -> str:
    """Kill `proc` if it still runs; its stderr."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    err = proc.stderr.read()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if not f.closed:
            f.close()
    return err


@pytest.fixture
def listener():
    with socket.create_server(("127.0.0.1", 0)) as s:
        s.settimeout(30)
        yield s


def test_a_peer_that_hangs_up_during_the_join_ends_the_rank_at_once_saying_which(listener, tmp_path):
    (tmp_path / "ring").mkdir()
    proc, conn = _rank(listener, tmp_path, join_seconds=120)
    try:
        t0 = time.monotonic()
        conn.close()  # rank 0 exits
        proc.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        err = _end(proc)
    assert took < 5
    assert proc.returncode == -15  # SIGTERM: the join holds the GIL, so nothing else could end it
    assert "rank 0 hung up while the ranks joined, so the cluster cannot start: rank 1 stops" in err, err
    assert not (tmp_path / "ring").exists()  # what the rank would have removed after its join


def test_the_watcher_ends_with_the_join_and_holds_no_connection_after_it(listener, tmp_path):
    proc, conn = _rank(listener, tmp_path, join_seconds=0.5)
    try:
        assert proc.stdout.readline() == "joined\n"
        conn.settimeout(1)
        with pytest.raises(TimeoutError):
            conn.recv(1)  # the rank lives on, its connection open
        assert proc.poll() is None
        proc.stdin.close()  # the rank exits: its peer sees that at once, as no watcher holds a copy
        conn.settimeout(10)
        assert conn.recv(1) == b""
        assert proc.wait(timeout=10) == 0
    finally:
        _end(proc)


def test_data_from_a_peer_during_the_join_is_not_a_hang_up(listener, tmp_path):
    proc, conn = _rank(listener, tmp_path, join_seconds=2)
    try:
        conn.sendall(b"LOADED")  # a rank that joined and loaded first
        assert proc.stdout.readline() == "joined\n"
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    finally:
        _end(proc)
        conn.close()


def test_a_rank_killed_during_its_join_takes_its_watcher_with_it(listener, tmp_path):
    """The watcher's copies of the sockets must not keep the rank's connections open after it died; what
    the rank would have removed, its watcher removes (a local cluster's directory stayed in /tmp when rank 0
    was killed in its join, or ended by its join's deadline)."""
    (tmp_path / "ring").mkdir()
    proc, conn = _rank(listener, tmp_path, join_seconds=120)
    err = _end(proc)  # read to its end: the watcher's own output included
    assert "rank 1 ended while the ranks joined, before it got through" in err, err
    conn.settimeout(10)
    assert conn.recv(1) == b""  # at once, not when the watcher would have timed out
    deadline = time.monotonic() + 10
    while (tmp_path / "ring").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "ring").exists()


def test_a_rank_through_its_join_keeps_what_it_owns(listener, tmp_path):
    (tmp_path / "ring").mkdir()
    proc, conn = _rank(listener, tmp_path, join_seconds=0.5)
    try:
        assert proc.stdout.readline() == "joined\n"
        time.sleep(0.5)  # the watcher has ended
        assert (tmp_path / "ring").is_dir()
    finally:
        _end(proc)
        conn.close()


def _ctrl_c(proc: subprocess.Popen, conn: socket.socket) -> tuple[subprocess.Popen, str]:
    """Ctrl-C to the rank's process group the moment it enters the join; the rank once ended, its stderr."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        err = _end(proc)
        conn.close()
    return proc, err


def test_ctrl_c_during_the_join_ends_the_rank_that_cannot_hear_it(listener, tmp_path):
    """Ctrl-C reaches the rank's whole process group, its watcher included; the rank, in the join, cannot act
    on it, so the watcher ends it, and says so. The rank enters the join only once its watcher takes Ctrl-C,
    so one sent the moment the join starts is not lost in the watcher's start-up (which once died of it,
    with a traceback)."""
    proc, err = _ctrl_c(*_rank(listener, tmp_path, join_seconds=120))
    assert proc.returncode == -signal.SIGTERM
    assert "meshlm: interrupted while the ranks joined: rank 1 stops" in err and "Traceback" not in err, err


def test_ctrl_c_that_the_rank_hears_itself_is_left_to_the_rank(listener, tmp_path):
    """Outside the join proper (its Python around it), the rank acts on Ctrl-C itself: the watcher, given
    a moment, sees the watched part end and leaves the rank's own exit alone."""
    proc, err = _ctrl_c(*_rank(listener, tmp_path, join_seconds=120, ears="hears"))
    assert proc.returncode == 130, err
    assert "the rank heard Ctrl-C" in err and "interrupted while" not in err and "Traceback" not in err, err
