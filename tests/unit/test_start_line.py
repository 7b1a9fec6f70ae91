"""The local cluster's start line: rank 0 gives the word only once every worker is there, and a worker
that died, a worker that never came and a rank 0 that died all end the start with an error naming them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from meshlm.cluster.bootstrap import ClusterError
from meshlm.cluster.start_line import StartLine


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def as_leader(directory, pid: int) -> StartLine:
    """The line rank `pid` would have created (a worker's parent is rank 0: here a test's workers are
    threads, whose parent is the test's own)."""
    (directory / "leader").write_text(str(pid))
    return StartLine(directory)


def test_the_word_is_given_once_every_worker_is_at_the_line(tmp_path):
    kids = [sleeper(), sleeper()]
    try:
        leader = StartLine.create(tmp_path)
        assert (tmp_path / "leader").read_text() == str(os.getpid())
        as_leader(tmp_path, os.getppid())
        done: list[int] = []

        def follow(rank: int) -> None:
            StartLine(tmp_path).follow(rank, timeout=10)
            done.append(rank)

        threads = [threading.Thread(target=follow, args=(1,)),
                   threading.Thread(target=leader.lead, args=(kids, 10))]
        for t in threads:
            t.start()
        time.sleep(0.2)
        assert not done and not (tmp_path / "go").exists()  # rank 0 waits: rank 2 is not there yet
        threads.append(threading.Thread(target=follow, args=(2,)))
        threads[-1].start()
        for t in threads:
            t.join(5)
        assert sorted(done) == [1, 2] and (tmp_path / "go").exists()
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_a_worker_that_exits_first_is_named_with_its_status(tmp_path):
    alive, dead = sleeper(), subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    try:
        (tmp_path / "ready-1").touch()
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match="rank 2 exited with status 3 before joining"):
            StartLine(tmp_path).lead([alive, dead], timeout=60)
        assert time.monotonic() - t0 < 5  # at once, not at the deadline
        assert not (tmp_path / "go").exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_worker_that_never_comes_ends_the_start_at_the_deadline(tmp_path):
    kid = sleeper()
    try:
        with pytest.raises(ClusterError, match=r"rank\(s\) 1 did not reach the cluster's start within 0 s"):
            StartLine(tmp_path).lead([kid], timeout=0.2)
    finally:
        kid.kill()
        kid.wait()


def test_a_worker_whose_rank_0_died_stops_waiting(tmp_path):
    # Not our parent: as if rank 0 had died, even before this worker looked, and it had been re-parented.
    line = as_leader(tmp_path, os.getppid() + 1)
    with pytest.raises(ClusterError, match="rank 0 ended before the cluster formed"):
        line.follow(1, timeout=60)
    assert not tmp_path.exists()  # the cluster's directory goes with it: rank 0 cannot remove it now


def test_a_worker_waits_for_rank_0_only_until_its_deadline(tmp_path):
    with pytest.raises(ClusterError, match="rank 0 did not start the cluster within 0 s"):
        as_leader(tmp_path, os.getppid()).follow(1, timeout=0.2)


def test_a_worker_without_a_line_is_refused(tmp_path):
    with pytest.raises(ClusterError, match="no start line"):
        StartLine(tmp_path).follow(1, timeout=10)
