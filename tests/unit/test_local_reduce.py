"""The shared-memory all-reduce (csrc/local_reduce.cpp) between real processes: sums exact and the same
bits on every rank, any size, and every way a group can be wrong ends in an error, never a hang."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from meshlm.transport.local_reduce import (PEER_LOST, SLOT_BYTES, SharedMemoryGroup, group_path, is_peer_lost,
                                           native_module, ring_is_local, spin_us)

NATIVE, STATUS = native_module()
NEEDS_NATIVE = pytest.mark.skipif(NATIVE is None, reason=f"local all-reduce not built: {STATUS}")

# A rank: joins (rank 0 creates first), sums each size's input (seeded by rank), prints one JSON line of
# digests per size, then follows `then` (exit at once, or wait to be killed).
RANK = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from pathlib import Path
    import mlx.core as mx
    import numpy as np
    from meshlm.transport.local_reduce import SharedMemoryGroup, native_module
    path, rank, world, sizes, then = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    native, _ = native_module()
    g = SharedMemoryGroup(Path(path), rank, world, native, 0.0)
    if rank == 0:
        g.create()
    else:  # the file exists before rank 0 has sized it: join once it has (the leader welcomes ranks after)
        deadline = time.monotonic() + 30
        while True:
            try:
                g.join()
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    out = {}
    for n in sizes:
        x = np.random.default_rng([rank, n]).standard_normal(n).astype(np.float32)
        y = g.all_sum(mx.array(x).reshape(-1, 1) if n % 2 else mx.array(x).reshape(2, -1))
        mx.eval(y)
        out[n] = hashlib.sha256(np.array(y).reshape(-1).tobytes()).hexdigest()
    print(json.dumps({"rank": rank, "digests": out, "stats": g.stats()}), flush=True)
    if then == "hang":
        time.sleep(60)
    elif then == "sum-again":
        try:
            mx.eval(g.all_sum(mx.ones((4,))))
            print(json.dumps({"rank": rank, "error": None}), flush=True)
        except RuntimeError as e:
            print(json.dumps({"rank": rank, "error": str(e)}), flush=True)
""")


@pytest.fixture()
def start():
    """start(path, rank, world, sizes, then="exit") runs a rank; any still running at the end is killed (a
    failed test must not leave ranks waiting in a sum)."""
    procs: list[subprocess.Popen] = []

    def run(path: Path, rank: int, world: int, sizes: list[int], then: str = "exit") -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(path), str(rank), str(world),
                                       json.dumps(sizes), then], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        return procs[-1]

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def expected_digest(n: int, world: int) -> str:
    total = np.zeros(n, np.float32)
    for r in range(world):  # in rank order, as every rank adds
        total = total + np.random.default_rng([r, n]).standard_normal(n).astype(np.float32)
    return hashlib.sha256(total.tobytes()).hexdigest()


@pytest.fixture()
def shm_path(tmp_path) -> Path:
    return tmp_path / "group"


@NEEDS_NATIVE
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_exact_sum_in_the_same_bits(shm_path, world, start):
    floats_per_slot = SLOT_BYTES // 4
    sizes = [2, 1024 * 16, floats_per_slot, floats_per_slot * 2 + 2]  # one round, exactly one slot, three rounds
    procs = [start(shm_path, r, world, sizes) for r in range(world)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].splitlines()[-1]) for o in outs]
    for res in results:
        assert res["digests"] == {str(n): expected_digest(n, world) for n in sizes}
        count, seconds, waiting = res["stats"]
        assert count == len(sizes) and 0 <= waiting <= seconds


@NEEDS_NATIVE
def test_a_peer_that_exits_fails_the_waiting_sum_instead_of_hanging(shm_path, start):
    # Rank 1 exits after the first sums; rank 0 sums again and must hear that its peer is gone.
    survivor = start(shm_path, 0, 2, [8], then="sum-again")
    leaver = start(shm_path, 1, 2, [8], then="exit")
    leaver.communicate(timeout=60)
    t0 = time.monotonic()
    out, err = survivor.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    last = json.loads(out.splitlines()[-1])
    assert last["error"] is not None and last["error"].startswith(PEER_LOST) and "rank 1" in last["error"], err[-2000:]


@NEEDS_NATIVE
def test_abort_wakes_every_rank_waiting_in_a_sum(shm_path, start):
    waiting = start(shm_path, 1, 2, [], then="sum-again")  # joins, then waits in a sum rank 0 never starts
    g = SharedMemoryGroup(shm_path, 0, 2, NATIVE, 0.0)
    g.create()
    try:
        time.sleep(0.5)
        g.abort()
        out, err = waiting.communicate(timeout=10)
        last = json.loads(out.splitlines()[-1])
        assert last["error"] is not None and "gave up" in last["error"], err[-2000:]
        with pytest.raises(RuntimeError, match="peer lost") as lost:
            mx.eval(g.all_sum(mx.ones((4,))))
        assert is_peer_lost(lost.value)  # the engine logs it as a lost rank, not as a bug
    finally:
        waiting.kill()


@NEEDS_NATIVE
def test_joining_a_group_that_is_not_there_or_not_this_layout_is_an_error(shm_path):
    with pytest.raises(RuntimeError, match="every rank on this machine"):
        SharedMemoryGroup(shm_path, 1, 2, NATIVE, 0.0).join()
    SharedMemoryGroup(shm_path, 0, 2, NATIVE, 0.0).create()
    with pytest.raises(RuntimeError, match="layout"):
        SharedMemoryGroup(shm_path, 1, 3, NATIVE, 0.0).join()
    with pytest.raises(RuntimeError, match="before the ranks joined"):
        SharedMemoryGroup(shm_path, 1, 2, NATIVE, 0.0).all_sum(mx.ones((2,)))
    with pytest.raises(ValueError):
        NATIVE.LocalGroup(str(shm_path), 2, 2, SLOT_BYTES, 0.0, False)


@NEEDS_NATIVE
def test_the_group_file_is_removed_by_rank_0_once_every_rank_has_it(shm_path):
    leader = SharedMemoryGroup(shm_path, 0, 2, NATIVE, 0.0)
    leader.create()
    leader.remove_file(only_once_joined=True)  # rank 1 has not mapped it yet
    assert shm_path.exists()
    worker = SharedMemoryGroup(shm_path, 1, 2, NATIVE, 0.0)
    worker.join()
    worker.remove_file()
    assert shm_path.exists()
    leader.remove_file(only_once_joined=True)
    assert not shm_path.exists()


def test_group_path_is_shared_by_one_cluster_and_differs_between_clusters():
    a = group_path("secret-one", "127.0.0.1:5000")
    assert a == group_path("secret-one", "127.0.0.1:5000")
    assert a != group_path("secret-two", "127.0.0.1:5000") != group_path("secret-one", "127.0.0.1:5001")
    assert "secret" not in a.name


def test_only_a_ring_on_loopback_counts_as_local(tmp_path):
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    assert ring_is_local(ring)
    ring.write_text(json.dumps([["127.0.0.1:5000"], ["10.0.0.2:5001"]]))
    assert not ring_is_local(ring)
    ring.write_text("not json")
    assert not ring_is_local(ring) and not ring_is_local(None) and not ring_is_local(tmp_path / "missing")


def test_ranks_spin_only_with_a_core_each():
    cores = os.cpu_count() or 1
    assert spin_us(1) > 0
    if len(os.sched_getaffinity(0)) == cores:  # not pinned: spinning ranks would compete for the cores
        assert spin_us(cores + 1) == 0


def test_the_module_is_built_where_a_compiler_is():
    if sys.platform != "linux" or not shutil.which("g++"):
        pytest.skip("scripts/build_native.py builds on Linux with g++")
    assert NATIVE is not None, STATUS
