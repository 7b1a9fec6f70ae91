"""Two hosts: a TP=2 cluster, a two-stage pipeline and a CP=2 cluster, across two network namespaces
joined by veth, started by `meshlm launch`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

CLIENT = """
import json, sys, time, httpx
url = sys.argv[1]
deadline = time.time() + 120
while time.time() < deadline:
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.3)
prompts = json.loads(sys.argv[2])
out = [httpx.post(url + "/v1/completions", timeout=60, json={"prompt": p, "max_tokens": 12, "temperature": 0})
       .json()["choices"][0]["text"] for p in prompts]
print(json.dumps(out))
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture()
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    tag = f"{os.getpid() % 10000}"
    a, b = f"mlA{tag}", f"mlB{tag}"
    ips = ("10.231.7.1", "10.231.7.2")
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, ip in ((a, f"va{tag}", ips[0]), (b, f"vb{tag}", ips[1])):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    yield (a, ips[0]), (b, ips[1])
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("secret_in", ["hostfile", "env"])
def test_tp2_across_two_namespaces_matches_single_process(two_hosts, tmp_path, secret_in):
    from meshlm.model.demo import make_tiny

    (a, ip_a), (b, ip_b) = two_hosts
    model = make_tiny(tmp_path / "tiny-kv4", "llama", layers=2, hidden=64, heads=4, kv_heads=4)
    hostfile = tmp_path / "hosts.json"
    secret = "multihost-test-secret-0123456789abcdef"
    hosts = [{"ssh": f"netns:{a}", "ips": [ip_a]}, {"ssh": f"netns:{b}", "ips": [ip_b]}]
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_CLUSTER_SECRET"}
    if secret_in == "hostfile":  # the hostfile's object form carries it to every rank
        hostfile.write_text(json.dumps({"secret": secret, "hosts": hosts}))
        hostfile.chmod(0o600)
    else:  # meshlm launch passes its environment on to the ranks it starts on this machine
        hostfile.write_text(json.dumps(hosts))
        env["MESHLM_CLUSTER_SECRET"] = secret
    prompts = [f"host test {i} about rivers" for i in range(4)]
    got, ring, code = _launch_and_ask(a, ip_a, hostfile, model, env, tmp_path, prompts)
    assert code == 0
    assert "all 2 ranks joined" in ring
    assert secret not in ring
    assert got == _single_process(model, prompts)


def _launch_and_ask(ns: str, ip: str, hostfile, model, env: dict, tmp_path, prompts: list[str],
                    serve_args: tuple[str, ...] = ()) -> tuple[list[str], str, int]:
    """`meshlm launch` the hostfile's cluster (rank 0 serving on ip:8000), ask it `prompts` from inside
    namespace `ns`, stop it; returns the texts, the launch log and launch's exit status."""
    log = (tmp_path / "launch.log").open("wb")
    cluster = subprocess.Popen(
        [sys.executable, "-m", "meshlm", "launch", "--hostfile", str(hostfile), "--", "serve", "--model", str(model),
         *serve_args, "--host", ip, "--port", "8000", "--kv-cache-dir", str(tmp_path / "kv")],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, f"http://{ip}:8000",
                              json.dumps(prompts)], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr + (tmp_path / "launch.log").read_text()[-2000:]
        got = json.loads(out.stdout)
    finally:
        cluster.send_signal(signal.SIGTERM)
        cluster.wait(30)
    return got, (tmp_path / "launch.log").read_text(), cluster.returncode


def _single_process(model, prompts: list[str]) -> list[str]:
    single = subprocess.run([sys.executable, "-c", _single_process_script(), str(model), json.dumps(prompts)],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    return json.loads(single.stdout)


def test_two_pipeline_stages_across_two_namespaces_match_single_process(two_hosts, tmp_path):
    from meshlm.model.demo import make_tiny

    (a, ip_a), (b, ip_b) = two_hosts
    model = make_tiny(tmp_path / "tiny-4l", "llama", layers=4, hidden=64, heads=4, kv_heads=2)
    hostfile = tmp_path / "hosts.json"
    secret = "multihost-test-secret-0123456789abcdef"
    hostfile.write_text(json.dumps({"secret": secret, "hosts": [{"ssh": f"netns:{a}", "ips": [ip_a]},
                                                                {"ssh": f"netns:{b}", "ips": [ip_b]}]}))
    hostfile.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_CLUSTER_SECRET"}
    prompts = [f"stage test {i} about rivers" for i in range(4)]
    got, text, code = _launch_and_ask(a, ip_a, hostfile, model, env, tmp_path, prompts,
                                      ("--pipeline-parallel", "2", "--pp-split", "1,3"))
    assert code == 0, text[-2000:]
    assert "all 2 stages joined" in text and "stage 0 of 2 (rank 1): layers 0..0 of 4" in text
    assert secret not in text
    assert got == _single_process(model, prompts)


def test_context_parallel_across_two_namespaces_matches_single_process(two_hosts, tmp_path):
    from meshlm.model.demo import make_tiny

    (a, ip_a), (b, ip_b) = two_hosts
    model = make_tiny(tmp_path / "tiny-cp", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"secret": "multihost-test-secret-0123456789abcdef",
                                    "hosts": [{"ssh": f"netns:{a}", "ips": [ip_a]}, {"ssh": f"netns:{b}", "ips": [ip_b]}]}))
    hostfile.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_CLUSTER_SECRET"}
    # Long enough that both ranks hold positions of every prompt (64 per block of 2 x 32).
    prompts = [f"context test {i}: " + "the river runs past the old mill " * (10 + 7 * i) for i in range(4)]
    got, text, code = _launch_and_ask(a, ip_a, hostfile, model, env, tmp_path, prompts, ("--context-parallel", "2"))
    assert code == 0, text[-2000:]
    assert "all 2 ranks joined" in text
    assert got == _single_process(model, prompts)


@pytest.mark.parametrize("layout", [(), ("--pipeline-parallel", "2")], ids=["tp", "pp"])
def test_a_worker_that_never_starts_ends_the_launch_at_once(two_hosts, tmp_path, layout):
    """Rank 1's host cannot run it (here a namespace that does not exist, as an ssh that fails): it never
    answers the roll call. `meshlm launch` sees it exit and tells the leader it started, which ends the
    start at once, naming it, instead of at the roll call's 180 s deadline."""
    from meshlm.model.demo import make_tiny

    (a, ip_a), _ = two_hosts
    model = make_tiny(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"secret": "multihost-test-secret-0123456789abcdef",
                                    "hosts": [{"ssh": f"netns:{a}", "ips": [ip_a]},
                                              {"ssh": "netns:meshlm-no-such-namespace", "ips": ["10.231.7.9"]}]}))
    hostfile.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_CLUSTER_SECRET"}
    launch = subprocess.run(
        [sys.executable, "-m", "meshlm", "launch", "--hostfile", str(hostfile), "--", "serve", "--model", str(model),
         *layout, "--host", ip_a, "--port", "8000", "--kv-cache-dir", str(tmp_path / "kv")],
        capture_output=True, text=True, env=env, timeout=60)  # the roll call alone would wait 180 s
    said = "rank 1 (netns:meshlm-no-such-namespace) exited with status"
    assert launch.returncode == 2, launch.stderr[-2000:]
    assert said in launch.stderr and "(reported by meshlm launch)" in launch.stderr, launch.stderr[-2000:]


def _single_process_script() -> str:
    return """
import json, sys
from mlx_lm import load
from mlx_lm.generate import generate_step
import mlx.core as mx
model, tok = load(sys.argv[1])
outs = []
for p in json.loads(sys.argv[2]):
    ids = [t for t, _ in generate_step(mx.array(tok.encode(p)), model, max_tokens=12)]
    outs.append(tok.decode([int(i) for i in ids]))
print(json.dumps(outs))
"""


def test_a_host_that_vanishes_while_the_ranks_load_ends_the_start(two_hosts, tmp_path):
    """Rank 1 joins the group, then is held before its load (the tests' stall_load fault) while rank 0
    loads and waits for its LOADED. Rank 1's host then vanishes: its link goes down, so nothing closes
    any connection. The keepalives of rank 0's control connection fail, which ends rank 0's wait (or its
    join watcher, were it still loading) within --step-timeout's liveness, naming rank 1."""
    from conftest import FAULT_ENTRY

    from meshlm.model.demo import make_tiny

    (a, ip_a), (b, ip_b) = two_hosts
    model = make_tiny(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": f"netns:{a}", "ips": [ip_a]}, {"ssh": f"netns:{b}", "ips": [ip_b]}]))
    env = {**os.environ, "MESHLM_CLUSTER_SECRET": "multihost-test-secret-0123456789abcdef",
           "MESHLM_OPENBLAS": "0", "OPENBLAS_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = []
    for rank, ns, launcher in ((0, a, ("-m", "meshlm")), (1, b, (FAULT_ENTRY, "stall_load", "3600"))):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, *launcher, "serve", "--model", str(model), "--rank", str(rank),
             "--hostfile", str(hostfile), "--tensor-parallel", "2", "--step-timeout", "6",
             "--kv-cache-dir", str(tmp_path / f"kv{rank}")],
            env=env, stdout=subprocess.DEVNULL, stderr=logs[rank].open("wb")))
    try:
        deadline = time.monotonic() + 60
        while "stalling the load" not in logs[1].read_text():
            assert time.monotonic() < deadline and procs[1].poll() is None, logs[1].read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)  # rank 0 reaches its load's collective
        vb = subprocess.run(["ip", "-n", b, "-o", "link", "show", "type", "veth"], capture_output=True,
                            text=True, check=True).stdout.split(":")[1].strip().split("@")[0]
        sh("ip", "-n", b, "link", "set", vb, "down")
        t0 = time.monotonic()
        code = procs[0].wait(60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    log = logs[0].read_text()
    assert took < 30, took
    if code == 2:  # rank 0 had loaded: its LOADED wait saw the connection time out
        assert "rank 1 hung up before it had loaded its share (receive failed" in log and "timed out" in log, \
            log[-2000:]
    else:
        assert code == -signal.SIGTERM, log[-2000:]
        assert "rank 1 was lost (" in log and "its host may be down or unreachable" in log, log[-2000:]
