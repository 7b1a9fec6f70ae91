"""`meshlm launch` and hostfiles: the command each rank gets, the cluster secret, and the mistakes refused."""

from __future__ import annotations

import dataclasses
import json
import re
import logging
import os
import signal
import subprocess
import sys
import socket
import threading
import time
from unittest import mock

import pytest

from meshlm.transport.auth import SECRET_ENV, ClusterSecret
from meshlm.cluster.bootstrap import ClusterError, Host, cluster_secret, load_hostfile, read_hostfile, ring_hostfile
from meshlm.cluster.launch import check_secret, rank_argv, rank_command

SECRET = "0123456789abcdef" * 4


def test_local_netns_and_ssh_hosts():
    cmd = ["python", "-m", "meshlm", "serve"]
    assert rank_command(Host("localhost", ("127.0.0.1",)), cmd, "/w") == cmd
    assert rank_command(Host("netns:a", ("10.0.0.1",)), cmd, "/w") == ["ip", "netns", "exec", "a", *cmd]
    remote = rank_command(Host("mac2.local", ("10.0.0.2",)), cmd, "/w w")
    assert remote[:2] == ["ssh", "-o"] and remote[-2] == "mac2.local"
    assert remote[-1] == "cd '/w w' && exec python -m meshlm serve"


def test_rank_argv_for_pipeline_stages(tmp_path):
    hosts = tmp_path / "hosts.json"
    argv = rank_argv(["serve", "--model", "m", "--pipeline-parallel", "2"], hosts, "ring", 2, 1)
    assert argv[-6:] == ["--hostfile", str(hosts), "--backend", "ring", "--rank", "1"]
    assert "--tensor-parallel" not in argv
    with pytest.raises(ClusterError, match="--pipeline-parallel 3 but the hostfile lists 2 hosts"):
        rank_argv(["serve", "--pipeline-parallel=3"], hosts, "ring", 2, 0)


@pytest.mark.parametrize("flag", ["--pipeline-parallel", "--context-parallel"])
def test_rank_counts_are_compared_as_serve_reads_them(tmp_path, flag):
    hosts = tmp_path / "hosts.json"
    assert rank_argv(["serve", flag, "02"], hosts, "ring", 2, 1)[-1] == "1"  # serve reads 02 as 2
    with pytest.raises(ClusterError, match=f"{flag} takes an integer, got 'two'"):
        rank_argv(["serve", f"{flag}=two"], hosts, "ring", 2, 0)


def test_rank_argv_for_context_parallel_ranks(tmp_path):
    hosts = tmp_path / "hosts.json"
    argv = rank_argv(["serve", "--model", "m", "--context-parallel", "2"], hosts, "ring", 2, 1)
    assert argv[-6:] == ["--hostfile", str(hosts), "--backend", "ring", "--rank", "1"]
    assert "--tensor-parallel" not in argv
    with pytest.raises(ClusterError, match="--context-parallel 4 but the hostfile lists 2 hosts"):
        rank_argv(["serve", "--context-parallel", "4"], hosts, "ring", 2, 0)


def test_rank_argv_adds_cluster_flags_and_refuses_conflicts(tmp_path):
    hosts = tmp_path / "h.json"
    argv = rank_argv(["serve", "--model", "m"], hosts, "ring", 2, 1)
    assert argv[-8:] == ["--hostfile", str(hosts), "--backend", "ring", "--tensor-parallel", "2", "--rank", "1"]
    with pytest.raises(ClusterError, match="--rank is set by meshlm launch"):
        rank_argv(["serve", "--rank", "1"], hosts, "ring", 2, 1)
    with pytest.raises(ClusterError, match="--tensor-parallel is set by meshlm launch"):  # the = form too
        rank_argv(["serve", "--tensor-parallel=3"], hosts, "ring", 2, 1)
    with pytest.raises(ClusterError, match="usage"):
        rank_argv(["--model", "m"], hosts, "ring", 2, 0)


def test_hostfile_formats(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]))
    hosts = read_hostfile(good)
    assert hosts == [Host("a", ("10.0.0.1",)), Host("b", ("b",))]
    assert ring_hostfile(hosts, 5000) == [["10.0.0.1:5000"], ["b:5001"]]
    for text in ("[]", "{", '[{"ips": []}]', '{"secret": "' + SECRET + '"}', '{"hosts": []}', '"x"'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ClusterError, match="hostfile"):
            read_hostfile(bad)


def launch_cli(hosts, backend: str = "ring", env: dict[str, str] | None = None,
               *serve_flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm", "launch", "--hostfile", str(hosts), "--backend", backend, "--dry-run",
         "--", "serve", "--model", "m", *serve_flags], capture_output=True, text=True, env=env)


def test_dry_run_prints_one_command_per_rank_or_one_mpirun(tmp_path):
    hosts = tmp_path / "h.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    env = {**os.environ, SECRET_ENV: SECRET}
    ring = launch_cli(hosts, env=env).stdout.splitlines()
    # The leader hears launch on its stdin (a worker that failed: cluster/launch.py, _supervise).
    assert len(ring) == 2 and ring[0].endswith("--rank 0 --launch-fd 0") and ring[1].endswith("--rank 1")
    assert not any(SECRET in line for line in ring)  # the secret never goes on a command line
    mpi = launch_cli(hosts, "mpi", env).stdout.splitlines()
    assert len(mpi) == 1 and mpi[0].startswith("mpirun -np 2 --host localhost,localhost") and "--rank" not in mpi[0]


def test_a_remote_leader_is_not_started_without_the_api_key_this_shell_has(tmp_path):
    """Regression: ssh does not forward MESHLM_API_KEY, so a leader on another host served with no key and
    nothing said so. launch refuses, unless --api-key is given; a local leader inherits the variable."""
    hosts = tmp_path / "h.json"
    hosts.write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]))
    env = {**os.environ, SECRET_ENV: SECRET, "MESHLM_API_KEY": "sk-1"}
    refused = launch_cli(hosts, env=env)
    assert refused.returncode != 0 and "ssh does not forward it to mac1" in refused.stderr
    assert launch_cli(hosts, "ring", env, "--api-key", "sk-1").returncode == 0
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "mac1", "ips": ["10.0.0.1"]}]))
    assert launch_cli(hosts, env=env).returncode == 0


@pytest.mark.parametrize("layout", [[], ["--pipeline-parallel", "2"], ["--context-parallel", "2"]])
def test_every_rank_under_mpirun_reads_its_rank_from_mpi(tmp_path, layout):
    """No --rank on mpirun's one command line: each process takes its rank from MPI's environment, which
    serve reads only with --backend mpi (cli._rank); without it every process was rank 0."""
    hosts = tmp_path / "h.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    mpi = launch_cli(hosts, "mpi", {**os.environ, SECRET_ENV: SECRET}, *layout).stdout.splitlines()
    assert len(mpi) == 1 and "--backend mpi" in mpi[0] and "--rank" not in mpi[0]


# -- the cluster secret ------------------------------------------------------------------------


def test_hostfile_object_form_carries_the_secret(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"secret": SECRET, "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]}))
    path.chmod(0o600)
    loaded = load_hostfile(path)
    assert loaded.hosts == (Host("a", ("10.0.0.1",)), Host("b", ("b",)))
    assert loaded.secret is not None and loaded.secret.reveal() == SECRET
    assert read_hostfile(path) == list(loaded.hosts)
    assert SECRET not in repr(loaded) and SECRET not in str(dataclasses.asdict(loaded))
    assert cluster_secret({}, loaded).reveal() == SECRET
    other = "f" * 40
    assert cluster_secret({SECRET_ENV: other}, loaded).reveal() == other  # the environment wins


def test_a_readable_hostfile_with_a_secret_is_warned_about(tmp_path, caplog):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"secret": SECRET, "hosts": [{"ssh": "a"}]}))
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        load_hostfile(path)
    assert "other users can read it: chmod 600" in caplog.text and SECRET not in caplog.text


@pytest.mark.parametrize("entries, words", [
    # ssh would read the name as an option: -oProxyCommand runs a command on the launching machine
    ([{"ssh": "-oProxyCommand=touch /tmp/x", "ips": ["10.0.0.1"]}], "\"ssh\" must be a host name"),
    ([{"ssh": "a b"}], "\"ssh\" must be a host name"),
    ([{"ssh": ""}], "\"ssh\" must be a host name"),
    ([{"ssh": "netns:-n"}], "the namespace of a \"netns:\" host must be"),  # an option of `ip netns exec`
    ([{"ssh": "netns:"}], "the namespace of a \"netns:\" host must be"),
    ([{"ssh": 7}], "\"ssh\" must be a host name"),
    ([{"ssh": "a", "ips": ["10.0.0.1 "]}], "an \"ips\" entry of a must be a host name"),
    ([{"ssh": "a", "ips": ["-x"]}], "an \"ips\" entry of a must be a host name"),
    ([{"ssh": "a", "ips": "10.0.0.1"}], "\"ips\" of a must be a list"),
    # the sockets took it for a host and failed with a traceback at the bind
    ([{"ssh": "a", "ips": ["127.0.0.1:99999"]}], "an \"ips\" entry of a must be an IP address (no port)"),
    ([{"ssh": "a", "ips": ["mac1.local"]}], "an \"ips\" entry of a must be an IP address (no port)"),
    ([{"ssh": "a", "memory_gb": 1e400}], "\"memory_gb\" must be a positive number, got inf"),
    ([1, 2], "each host is an object"),
])
def test_a_hostfile_entry_that_is_no_host_is_refused_naming_it(tmp_path, entries, words):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ClusterError, match=re.escape(words)):
        load_hostfile(path)


def test_a_hostfile_nested_past_the_parsers_depth_is_refused_in_a_sentence(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text("[" * 200_000)  # was a RecursionError traceback, status 1
    with pytest.raises(ClusterError, match="cannot read hostfile"):
        load_hostfile(path)


def test_hostfile_names_in_every_form_ssh_takes_are_read(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "user@mac1.local"}, {"ssh": "netns:b", "ips": ["fe80::1%eth0"]},
                                {"ssh": "c", "ips": []}]))
    assert [(h.ssh, h.ips) for h in load_hostfile(path).hosts] == [
        ("user@mac1.local", ("user@mac1.local",)), ("netns:b", ("fe80::1%eth0",)), ("c", ("c",))]


def test_a_cluster_without_a_secret_is_refused_saying_how_to_set_one(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "localhost"}] * 2))
    with pytest.raises(ClusterError, match=f"no secret: set {SECRET_ENV}.*\"secret\".*openssl rand -hex 32"):
        cluster_secret({}, load_hostfile(path))
    r = launch_cli(path, env={k: v for k, v in os.environ.items() if k != SECRET_ENV})
    assert r.returncode == 2 and "this cluster has no secret" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("source", ["env", "hostfile"])
def test_a_short_secret_is_refused_without_showing_it(tmp_path, source):
    short = "tooshort-but-private"
    path = tmp_path / "hosts.json"
    if source == "env":
        path.write_text(json.dumps([{"ssh": "localhost"}]))
        environ = {SECRET_ENV: short}
    else:
        path.write_text(json.dumps({"secret": short, "hosts": [{"ssh": "localhost"}]}))
        environ = {}
    with pytest.raises(ClusterError, match="20 characters long; a cluster secret needs at least 32") as info:
        cluster_secret(environ, load_hostfile(path))
    assert short not in str(info.value)


def test_secret_is_redacted_everywhere_but_reveal():
    secret = ClusterSecret.generate()
    text = secret.reveal()
    assert len(text) == 64 and int(text, 16) >= 0
    assert text not in repr(secret) and text not in str(secret) and text not in f"{secret}"
    assert ClusterSecret.generate().reveal() != text
    with pytest.raises(TypeError, match="never serialized"):
        __import__("pickle").dumps(secret)


def test_launch_checks_the_secret_only_where_it_can(monkeypatch, caplog):
    here = load_hostfile_from([{"ssh": "localhost"}, {"ssh": "netns:b"}])
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ClusterError, match="no secret"):
        check_secret(here)  # every rank starts here: none could get a secret
    remote = load_hostfile_from([{"ssh": "localhost"}, {"ssh": "mac2.local"}])
    with caplog.at_level(logging.WARNING):
        check_secret(remote)  # mac2 may set it in its own environment
    assert "mac2.local must each set MESHLM_CLUSTER_SECRET themselves" in caplog.text
    monkeypatch.setenv(SECRET_ENV, SECRET)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_secret(remote)
    assert "not forwarded over ssh: mac2.local" in caplog.text and SECRET not in caplog.text


def load_hostfile_from(entries: list[dict]):
    from meshlm.cluster.bootstrap import Hostfile

    return Hostfile(tuple(Host(e["ssh"], (e["ssh"],)) for e in entries), None)


def test_a_worker_that_exits_is_reported_while_the_leader_runs(caplog):
    from meshlm.cluster import launch

    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(7)"])
    worker = subprocess.Popen([sys.executable, "-c", "raise SystemExit(255)"])
    stopped = subprocess.Popen([sys.executable, "-c", "raise SystemExit(0)"])  # as a worker the leader stops
    handlers = {sig: signal.getsignal(sig) for sig in launch.STOP_SIGNALS}
    try:
        with caplog.at_level(logging.WARNING):
            assert launch._supervise([leader, worker, stopped], ["localhost", "mac2.local", "mac3.local"]) == 7
    finally:  # _supervise forwards these to its leader
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert caplog.text.count("rank 1 (mac2.local) exited with status 255 while the leader runs") == 1
    assert "mac3.local" not in caplog.text


def test_pipeline_ranks_told_the_control_address_still_find_every_stage(tmp_path, monkeypatch):
    """With a non-ring backend (mpi, jaccl) and --control-addr, the topology took the address as given and
    derived nothing else: a pipeline's stage addresses stayed None and its stage links failed with a
    TypeError traceback. They now come from the hostfile, as without --control-addr; without one, a sentence."""
    from meshlm.cluster.ranks import ClusterPorts, resolve_topology
    from meshlm.config import ParallelConfig

    monkeypatch.setenv(SECRET_ENV, "a" * 64)
    hostfile = tmp_path / "h.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    p = ParallelConfig(pipeline_parallel=2, backend="mpi", control_addr="10.0.0.1:5000", hostfile=str(hostfile),
                       rank=1, stage_port=6000)
    topo, local = resolve_topology(p, ClusterPorts())
    assert local is None and topo.parallel.stage_addrs == ("10.0.0.1:6000", "10.0.0.2:6001")
    with pytest.raises(ClusterError, match="needs --stage-addrs, or a --hostfile"):
        resolve_topology(dataclasses.replace(p, hostfile=None), ClusterPorts())


@pytest.mark.parametrize("leader_code, sig, want", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", None, 137),  # was 247 (256 - 9)
    ("import os, signal, time; time.sleep(30)", signal.SIGINT, 0),  # a stop launch forwarded: clean
    ("import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(130)); time.sleep(30)",
     signal.SIGINT, 0),  # a start interrupted before serving exits 130
    # The terminal hanging up: the leader (in a session of its own) never got it, and the cluster ran on
    ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(30)",
     signal.SIGHUP, 0),
])
def test_launch_exits_with_a_shells_status_for_a_signalled_leader(leader_code, sig, want):
    from meshlm.cluster import launch

    leader = subprocess.Popen([sys.executable, "-c", leader_code])
    handlers = {s: signal.getsignal(s) for s in launch.STOP_SIGNALS}
    try:
        if sig is not None:
            threading.Timer(1.0, os.kill, (os.getpid(), sig)).start()  # as a terminal's Ctrl-C to launch
        assert launch._supervise([leader], ["localhost"]) == want
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if leader.poll() is None:
            leader.kill()


def test_a_stop_while_the_ranks_start_reaches_the_leader_once_they_all_have(tmp_path, monkeypatch):
    """Ctrl-C amid the ranks' start ended launch at once ('interrupted', 130) and left the ranks already
    started retrying the roll call; a launch run again within the start timeout took one in as its own.
    The stop is held until every rank has started, then goes to the leader (SIGTERM), which stops; launch
    waits for every rank."""
    from meshlm.cluster import launch

    monkeypatch.setenv(SECRET_ENV, "a" * 64)
    handlers = {s: signal.getsignal(s) for s in launch.STOP_SIGNALS}
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 3))
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(cmd, **kw):  # the leader (its stdin launch's pipe) runs until told; a worker ends on its own
        seconds = 30 if kw.get("stdin") is not None else 2
        started.append(real([sys.executable, "-c", f"import time; time.sleep({seconds})"], **kw))
        if len(started) == 2:  # Ctrl-C as the second rank starts
            os.kill(os.getpid(), signal.SIGINT)
        return started[-1]

    try:
        with mock.patch.object(launch.subprocess, "Popen", popen), mock.patch.object(launch, "_check_tools"):
            t0 = time.monotonic()
            assert launch.launch(str(hosts), "ring", ["serve", "--model", "m"]) == 0
        assert [p.poll() for p in started] == [0, 0, -signal.SIGTERM]  # workers first, then the leader
        assert time.monotonic() - t0 < 8
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for p in started:
            if p.poll() is None:
                p.kill()


def test_ipv6_addresses_are_refused_for_the_ring_backend_before_any_rank_waits(tmp_path, monkeypatch):
    """MLX's ring backend reads ip:port ("Can't parse address ::1:21310"): such a hostfile failed only at the
    group's join, after the roll call. It is refused when the topology is resolved; other backends, and
    pipelines (stage links take IPv6), keep it."""
    from meshlm.cluster.ranks import ClusterPorts, resolve_topology
    from meshlm.config import ParallelConfig

    monkeypatch.setenv(SECRET_ENV, "a" * 64)
    hostfile = tmp_path / "h.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["::1"]}, {"ssh": "netns:b"}]))
    p = ParallelConfig(tensor_parallel=2, hostfile=str(hostfile), rank=1)
    with pytest.raises(ClusterError, match=r"ring backend takes IPv4 addresses .*: a \(::1\) in the hostfile"):
        resolve_topology(p, ClusterPorts())
    topo, _ = resolve_topology(dataclasses.replace(p, tensor_parallel=1, pipeline_parallel=2), ClusterPorts())
    assert topo.parallel.stage_addrs[0].startswith("::1:")


@pytest.mark.parametrize("form", ["::1:{}", "[::1]:{}"])
def test_a_stage_link_forms_over_ipv6(form):
    """A stage listened on IPv4 only: an IPv6 "ips" entry passed the hostfile's checks and failed at the bind.
    The bracketed form ([::1]:P, as in a URL) passed --stage-addrs' check and went to the resolver whole."""
    from meshlm.transport import stage_link
    from meshlm.transport.auth import ClusterSecret

    secret = ClusterSecret("a" * 64)
    server = stage_link.listen("::1", 0)
    port = server.getsockname()[1]
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("rx", stage_link.accept(server, secret, 1, 0, 5.0, 5.0)))
    t.start()
    tx = stage_link.connect(form.format(port), secret, 0, 1, 5.0, 5.0)
    t.join()
    assert out["rx"].peer == 0 and tx.peer == 1
    for s in (tx, out["rx"], server):
        s.close()


def test_a_bracketed_control_address_binds_its_host(monkeypatch):
    """--control-addr [::1]:P passed the check, then the leader bound "[::1]" and a worker dialled it."""
    from meshlm.cluster.ranks import ClusterPorts, control_leader, resolve_topology
    from meshlm.config import ParallelConfig

    monkeypatch.setenv(SECRET_ENV, "a" * 64)
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    p = ParallelConfig(tensor_parallel=2, control_addr=f"[::1]:{port}", backend="mpi", rank=0)
    topo, _ = resolve_topology(p, ClusterPorts())
    assert topo.control_bind == "::1"
    control_leader(topo).close()


def test_memory_declared_for_some_hosts_only_is_said_to_be_unused(tmp_path, monkeypatch, caplog):
    """The split in proportion to memory needs every host's: some only fell back to an even split silently."""
    from meshlm.cluster.ranks import ClusterPorts, resolve_topology
    from meshlm.config import ParallelConfig

    monkeypatch.setenv(SECRET_ENV, "a" * 64)
    hostfile = tmp_path / "h.json"
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"], "memory_gb": 64}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    with caplog.at_level(logging.WARNING):
        topo, _ = resolve_topology(ParallelConfig(pipeline_parallel=2, hostfile=str(hostfile), rank=1), ClusterPorts())
    assert topo.memory_gb is None and "memory_gb for some hosts only" in caplog.text
