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


def test_the_word_is_given_once_every_worker_is_at_the_line(tmp_path):
    kids = [sleeper(), sleeper()]
    try:
        leader = StartLine(tmp_path)
        workers = [StartLine(tmp_path, os.getppid()) for _ in kids]
        done: list[int] = []

        def follow(rank: int) -> None:
            # A worker's parent is rank 0; here the test process stands for it (leader_pid = our own ppid).
            workers[rank - 1].follow(rank, timeout=10)
            done.append(rank)

        threads = [threading.Thread(target=follow, args=(1,))]
        threads[0].start()
        time.sleep(0.1)
        assert not done and not (tmp_path / "go").exists()  # rank 2 is not there yet
        threads.append(threading.Thread(target=follow, args=(2,)))
        threads[1].start()
        leader.lead(kids, timeout=10)
        for t in threads:
            t.join(5)
        assert sorted(done) == [1, 2]
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
    # Not our parent: as if rank 0 had died and this process had been re-parented.
    line = StartLine(tmp_path, leader_pid=os.getppid() + 1)
    with pytest.raises(ClusterError, match="rank 0 ended before the cluster formed"):
        line.follow(1, timeout=60)
    assert (tmp_path / "ready-1").exists()


def test_a_worker_waits_for_rank_0_only_until_its_deadline(tmp_path):
    with pytest.raises(ClusterError, match="rank 0 did not start the cluster within 0 s"):
        StartLine(tmp_path, os.getppid()).follow(1, timeout=0.2)
