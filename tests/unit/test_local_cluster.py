"""A local cluster's watches while it starts (meshlm/cluster/bootstrap.py): rank 0 on the workers it
started, each worker on rank 0, its parent. Real child processes; no MLX."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys

import pytest

from meshlm.cluster.bootstrap import (LAUNCH_GONE, LEADER_FILE, ClusterError, LocalCluster, exited, launch_reports,
                                      local_leader_gone, start_watch, watch_launch)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_local_cluster_names_rank_0_beside_its_ring_file():
    cluster = LocalCluster.create(3)
    try:
        assert len(json.loads(cluster.hostfile.read_text())) == 3
        assert (cluster.hostfile.parent / LEADER_FILE).read_text() == str(os.getpid())
        assert len(set(cluster.stage_addrs) | {cluster.control_addr}) == 4
    finally:
        for f in cluster.hostfile.parent.iterdir():
            f.unlink()
        cluster.hostfile.parent.rmdir()


def test_the_first_worker_that_exited_is_named_with_its_status():
    alive, dead = sleeper(), subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    try:
        assert exited([alive]) is None
        assert exited([alive, dead]) == "rank 2 exited with status 3 before joining the cluster (its own output says why)"
    finally:
        alive.kill()
        alive.wait()


def test_a_worker_of_a_live_rank_0_waits(tmp_path):
    (tmp_path / LEADER_FILE).write_text(str(os.getppid()))  # this process's parent plays rank 0
    assert local_leader_gone(tmp_path / "ring.json")() is None
    assert tmp_path.exists()


def test_a_worker_whose_rank_0_died_says_so_and_removes_the_directory(tmp_path):
    # Not our parent: as if rank 0 had died, even before this worker looked, and it had been re-parented.
    (tmp_path / LEADER_FILE).write_text(str(os.getppid() + 1))
    assert local_leader_gone(tmp_path / "ring.json")() == "rank 0 ended before the cluster formed"
    assert not tmp_path.exists()  # rank 0 cannot remove it now


def test_a_worker_without_rank_0_named_is_refused(tmp_path):
    with pytest.raises(ClusterError, match="a local worker is started by rank 0"):
        local_leader_gone(tmp_path / "ring.json")


def test_rank_0_hears_launch_report_a_worker_only_once_a_whole_line_has_come():
    ear, mouth = os.pipe()
    try:
        heard = launch_reports(ear)
        assert heard() is None  # nothing yet: no wait either
        os.write(mouth, b"rank 2 (mac3.local) exited with status 255 while the le")
        assert heard() is None
        os.write(mouth, b"ader runs\n")
        assert heard() == "rank 2 (mac3.local) exited with status 255 while the leader runs (reported by meshlm launch)"
        os.close(mouth)  # launch gone: what was heard stays
        assert heard() is not None
    finally:
        os.close(ear)


def test_rank_0_hears_launch_go_while_the_cluster_starts_and_while_it_serves():
    """launch killed (SIGKILL, its ssh cut) closes its end of rank 0's pipe. While the cluster started that
    was read as silence; once it served, nothing read the pipe: the whole cluster served on with no one to
    stop it. Both now say launch is gone; serving, the leader is stopped as by SIGTERM."""
    ear, mouth = os.pipe()
    heard = launch_reports(ear)
    os.close(mouth)
    assert heard() == LAUNCH_GONE
    os.close(ear)
    ear, mouth = os.pipe()
    told: list[str] = []
    try:
        watcher = watch_launch(ear, told.append, poll_seconds=0.05)
        os.write(mouth, b"rank 1 (b) exited with status 1 while the leader runs\n")  # the control channel's
        time.sleep(0.2)
        assert told == [] and watcher.is_alive()
        os.close(mouth)
        watcher.join(5)
        assert told == [LAUNCH_GONE] and not watcher.is_alive()
    finally:
        os.close(ear)


def test_rank_0_watches_its_children_and_launch_alike():
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    ear, mouth = os.pipe()
    try:
        assert start_watch([], None) is None
        assert start_watch([dead], None)().startswith("rank 1 exited with status 3")
        quiet = start_watch([], ear)
        assert quiet() is None
        os.write(mouth, b"rank 1 (b) exited with status 1 while the leader runs\n")
        assert quiet().endswith("(reported by meshlm launch)")
    finally:
        os.close(ear)
        os.close(mouth)


def test_a_launch_descriptor_that_is_not_open_is_refused():
    with pytest.raises(ClusterError, match="--launch-fd 987: Bad file descriptor"):
        launch_reports(987)


BEGIN = """
import sys
from meshlm.cli import build_parser, serve_config
from meshlm.cluster.ranks import ClusterPorts, begin_cluster

argv = sys.argv[1:]
config = serve_config(build_parser().parse_args(argv))
with begin_cluster(config, argv[1:], ClusterPorts()) as start:
    heavy = [m for m in ("mlx_lm", "transformers", "fastapi", "uvicorn") if m in sys.modules]
    print(len(start.children), heavy, start.local.hostfile.parent.is_dir())
    start.abandon()
    print(start.local.hostfile.parent.exists(), [p.poll() is None for p in start.children])
"""


@pytest.mark.parametrize("layout", ["--tensor-parallel", "--pipeline-parallel", "--context-parallel"])
def test_rank_0_starts_its_ranks_before_it_imports_mlx_lm_or_the_http_stack(tmp_path, layout):
    """The ranks import theirs (~1.3 s) meanwhile on their own cores: started after rank 0's, they doubled
    a local cluster's start. A rank 0 that fails before forming the cluster ends the ranks it started."""
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path / "m", "llama", layers=2, hidden=32, heads=2, kv_heads=2)
    out = subprocess.run([sys.executable, "-c", BEGIN, "serve", "--model", str(model), layout, "2"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1 [] True", "False [False]"]


def test_every_supported_model_type_has_mlx_lms_tensor_parallel_split():
    """check_shardable no longer asks mlx-lm for the model class before any rank starts (that imports
    transformers, ~0.9 s, on rank 0's critical path); this is what made the question redundant."""
    from mlx_lm.utils import _get_classes

    from meshlm.model.adapt import SUPPORTED_TYPES

    for model_type in SUPPORTED_TYPES:
        model_class, _ = _get_classes({"model_type": model_type})
        assert callable(getattr(model_class, "shard", None)), model_type


@pytest.mark.parametrize("error, words", [
    ("[ring] Couldn't bind socket (error: 98)", "another process holds this rank's ring address"),
    ("[ring] Couldn't bind socket (error: 99)", "not an address of this machine (check its \"ips\""),
    ("[ring] Connection refused", ""),
])
def test_a_ring_that_cannot_bind_says_what_to_fix(error, words):
    """Error 99 (EADDRNOTAVAIL: a hostfile address this host lacks) sent operators to --ring-port."""
    from meshlm.cluster.bootstrap import _bind_hint

    hint = _bind_hint(error)
    assert (words in hint) if words else hint == ""


def test_a_new_local_cluster_removes_those_of_rank_0s_that_are_gone():
    """A rank 0 killed while its cluster started (systemd's SIGTERM to the whole group) left its directory
    (ring file, leader pid) behind for good (review helper-43); a live one's is kept."""
    dead = sleeper()
    dead.kill()
    dead.wait()
    abandoned, live = LocalCluster.create(2), LocalCluster.create(2)
    (abandoned.hostfile.parent / LEADER_FILE).write_text(str(dead.pid))
    cluster = LocalCluster.create(2)
    try:
        assert not abandoned.hostfile.parent.exists()
        assert live.hostfile.parent.is_dir() and cluster.hostfile.parent.is_dir()
    finally:
        for c in (live, cluster):
            for f in c.hostfile.parent.iterdir():
                f.unlink()
            c.hostfile.parent.rmdir()
