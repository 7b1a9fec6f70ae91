"""`meshlm launch`: the command each rank gets, and the mistakes it refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshlm.parallel.bootstrap import ClusterError, Host, read_hostfile, ring_hostfile
from meshlm.parallel.launch import rank_argv, rank_command


def test_local_netns_and_ssh_hosts():
    cmd = ["python", "-m", "meshlm", "serve"]
    assert rank_command(Host("localhost", ("127.0.0.1",)), cmd, "/w") == cmd
    assert rank_command(Host("netns:a", ("10.0.0.1",)), cmd, "/w") == ["ip", "netns", "exec", "a", *cmd]
    remote = rank_command(Host("mac2.local", ("10.0.0.2",)), cmd, "/w w")
    assert remote[:2] == ["ssh", "-o"] and remote[-2] == "mac2.local"
    assert remote[-1] == "cd '/w w' && exec python -m meshlm serve"


def test_rank_argv_adds_cluster_flags_and_refuses_conflicts(tmp_path):
    hosts = tmp_path / "h.json"
    argv = rank_argv(["serve", "--model", "m"], hosts, "ring", 2, 1)
    assert argv[-8:] == ["--hostfile", str(hosts), "--backend", "ring", "--tensor-parallel", "2", "--rank", "1"]
    with pytest.raises(ClusterError, match="--rank is set by meshlm launch"):
        rank_argv(["serve", "--rank", "1"], hosts, "ring", 2, 1)
    with pytest.raises(ClusterError, match="usage"):
        rank_argv(["--model", "m"], hosts, "ring", 2, 0)


def test_hostfile_formats(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]))
    hosts = read_hostfile(good)
    assert hosts == [Host("a", ("10.0.0.1",)), Host("b", ("b",))]
    assert ring_hostfile(hosts, 5000) == [["10.0.0.1:5000"], ["b:5001"]]
    for text in ("[]", "{", '[{"ips": []}]'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ClusterError, match="hostfile"):
            read_hostfile(bad)


def test_dry_run_prints_one_command_per_rank_or_one_mpirun(tmp_path):
    hosts = tmp_path / "h.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    run = lambda backend: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "meshlm", "launch", "--hostfile", str(hosts), "--backend", backend, "--dry-run",
         "--", "serve", "--model", "m"], capture_output=True, text=True, check=True).stdout.splitlines()
    ring = run("ring")
    assert len(ring) == 2 and ring[0].endswith("--rank 0") and ring[1].endswith("--rank 1")
    mpi = run("mpi")
    assert len(mpi) == 1 and mpi[0].startswith("mpirun -np 2 --host localhost,localhost") and "--rank" not in mpi[0]
