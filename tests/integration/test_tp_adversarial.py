"""The adversarial cases of tensor-parallel serving (reference §P8.7.1), each with real ranks.

Deadlock, token mismatch and partial failure (a killed worker) live in
test_tensor_parallel.py; this file covers the rest, including strangers on the
control port, ranks with the wrong cluster secret and ranks of another
protocol version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from conftest import FAULT_ENTRY, ServerProcess, fault_entry, free_port, free_port_run, process_environ
from test_tensor_parallel import alive, children, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("adv") / "tiny-kv4", "llama", layers=2, hidden=64, heads=4, kv_heads=4)


def tp_server(model, tmp_path, *args, env=None) -> ServerProcess:
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return ServerProcess(model, "--max-model-len", "4096", "--tensor-parallel", "2", *args, log_dir=tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(old)


def complete(url: str, prompt, n: int = 8, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout,
                      json={"prompt": prompt, "max_tokens": n, "temperature": 0})


def stop(srv: ServerProcess) -> None:
    kids = children(srv.proc.pid)
    srv.stop()
    for pid in kids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_oversized_prompt_crosses_the_control_plane(model, tmp_path):
    prompt = [(7 * i) % 500 + 3 for i in range(3500)]  # no fixed buffer: 3,500 token ids in one plan
    single = ServerProcess(model, "--max-model-len", "4096", "--no-prefix-cache", "--max-tokens-per-step", "4096",
                           log_dir=tmp_path)
    try:
        want = complete(single.url, prompt).json()["choices"][0]["text"]
    finally:
        single.stop()
    srv = tp_server(model, tmp_path, "--max-tokens-per-step", "4096")
    try:
        assert complete(srv.url, prompt).json()["choices"][0]["text"] == want
    finally:
        stop(srv)


def test_ssd_tier_is_rank_isolated_and_survives_restart(model, tmp_path):
    prompt = "the same long system prompt, again and again, " * 12
    srv = tp_server(model, tmp_path)
    try:
        first = complete(srv.url, prompt).json()
    finally:
        stop(srv)
    rank_dirs = sorted((tmp_path / "kv").glob("*/tp2-*/rank_*"))
    assert [d.name for d in rank_dirs] == ["rank_0", "rank_1"]
    names = [sorted(p.name for p in d.glob("*.safetensors")) for d in rank_dirs]
    assert names[0] == names[1] and names[0]  # identical keys on every rank
    for name in names[0]:  # but each rank holds its own shard of the KV
        assert (rank_dirs[0] / name).read_bytes() != (rank_dirs[1] / name).read_bytes()
    srv = tp_server(model, tmp_path)
    try:
        again = complete(srv.url, prompt).json()
    finally:
        stop(srv)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_another_ranks_shard_is_never_loaded(model, tmp_path):
    """A block file copied from rank 0 into rank 1's directory (same key) is foreign: dropped at start-up."""
    prompt = "shard isolation check, repeated words, " * 12
    srv = tp_server(model, tmp_path)
    try:
        first = complete(srv.url, prompt).json()
    finally:
        stop(srv)
    r0, r1 = sorted((tmp_path / "kv").glob("*/tp2-*/rank_*"))
    for f in r0.glob("*.safetensors"):
        (r1 / f.name).write_bytes(f.read_bytes())
    srv = tp_server(model, tmp_path)
    try:
        r = complete(srv.url, prompt)
        health = httpx.get(srv.url + "/health")
        failures = srv.metric("meshlm_prefix_cache_load_failures_total")
    finally:
        stop(srv)
    assert first["usage"]["completion_tokens"] == 8
    # Rank 1 dropped the foreign files, so it lacks blocks rank 0 offers: it never computes with them.
    # It reports them, and the leader recomputes the prompt: the same text, the cluster healthy. (It used
    # to fail the step: a 503, the cluster restarting into the same failure.)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == first["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert health.status_code == 200 and failures > 0


def test_silent_leader_makes_workers_exit(model, tmp_path):
    """The shutdown race: a leader that stops talking (SIGSTOP) loses its workers within --worker-timeout."""
    srv = tp_server(model, tmp_path, "--worker-timeout", "2")
    worker = children(srv.proc.pid)[0]
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: not alive(worker), 6)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        stop(srv)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_thousand_short_requests_leave_no_kv_behind(model, tmp_path):
    srv = tp_server(model, tmp_path, "--no-prefix-cache")
    worker = children(srv.proc.pid)[0]

    async def burst(c, start):
        rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": f"r{i}", "max_tokens": 2})
                                    for i in range(start, start + 50)])
        assert all(r.status_code == 200 for r in rs)

    async def run(n_batches, start):
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            for b in range(n_batches):
                await burst(c, start + 50 * b)

    try:
        asyncio.run(run(4, 0))
        base = rss_kb(worker)
        asyncio.run(run(16, 200))
        assert wait_until(lambda: srv.metric("meshlm_kv_blocks_used") == 0, 10)
        # Every step's ACK carries the worker's own batch fingerprint: a leaked sequence would be a split brain.
        assert httpx.get(srv.url + "/health").status_code == 200
        assert rss_kb(worker) - base < 64 * 1024
    finally:
        stop(srv)


# -- ranks started by hand from a hostfile, and what the cluster secret keeps out ----------------

SECRET = "integration-test-cluster-secret-0123456789"
WRONG_SECRET = "not-this-clusters-secret-9876543210-abcdef"
# A rank of another meshlm build: the same code speaking the next control protocol version.
OTHER_BUILD = ("import sys; from meshlm.transport import codec; codec.VERSION += 1; "
               "from meshlm.cli import main; main(sys.argv[1:])")


@dataclass(frozen=True)
class HandCluster:
    """A two-rank hostfile on loopback and the ports its ranks use (none may collide with the ring's)."""

    tmp: Path
    ring: range
    control: int
    http: int

    @classmethod
    def create(cls, tmp: Path) -> HandCluster:
        hosts = tmp / "hosts.json"
        hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
        ring = free_port_run(2)  # rank r listens on ring[r]: no other port of this test may land there
        return cls(tmp, ring, free_port(avoid=ring), free_port(avoid=ring))

    def start(self, model: Path, rank: int, *, secret: str | None = SECRET,
              launcher: tuple[str, ...] = ("-m", "meshlm"), env: dict[str, str] | None = None,
              extra: tuple[str, ...] = (), layout: tuple[str, ...] = ("--tensor-parallel", "2")) -> subprocess.Popen:
        """`meshlm serve --rank r`, its secret in MESHLM_CLUSTER_SECRET as a user would set it; stderr to a file."""
        environ = {k: v for k, v in os.environ.items() if k != "MESHLM_CLUSTER_SECRET"}
        scratch = self.scratch(rank)
        scratch.mkdir(exist_ok=True)
        environ.update({"OPENBLAS_NUM_THREADS": "1", "TMPDIR": str(scratch), **(env or {})})
        if secret is not None:
            environ["MESHLM_CLUSTER_SECRET"] = secret
        port = self.http if rank == 0 else free_port(avoid=self.ring)
        cmd = [sys.executable, *launcher, "serve", "--model", str(model), "--rank", str(rank), "--port", str(port),
               "--hostfile", str(self.tmp / "hosts.json"), *layout, "--ring-port", str(self.ring[0]),
               "--control-port", str(self.control), "--kv-cache-dir", str(self.tmp / "kv"), "--max-model-len", "512",
               *extra]
        return subprocess.Popen(cmd, env=environ, stdout=subprocess.DEVNULL, stderr=self.log(rank).open("wb"))

    def log(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.log"

    def scratch(self, rank: int) -> Path:
        """The rank's TMPDIR: what a rank writes there for itself (its MLX ring file) must be gone when it ends."""
        return self.tmp / f"tmp{rank}"

    def left_behind(self, *ranks: int) -> list[str]:
        return [f"rank {r}: {p.name}" for r in ranks for p in self.scratch(r).iterdir() if p.name.startswith("meshlm-")]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


def finish(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM the leader (it stops its workers), then make sure nothing is left."""
    procs[0].send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def kill_all(procs) -> None:
    """Kill whatever still runs of `procs` and reap them all (a test's cleanup after its ranks have ended)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a rank exited before the cluster was up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("cluster not healthy in time")


def wait_listening(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def log_time(log: str, pattern: str) -> datetime:
    """When a rank logged the first line matching `pattern` (the CLI's asctime, to the millisecond)."""
    for line in log.splitlines():
        if re.search(pattern, line):
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"no log line matches {pattern!r}:\n{log[-3000:]}")


def faulty_worker(hc: HandCluster, model: Path, kind: str, step: int, timeout: str) -> list[subprocess.Popen]:
    """A leader and a worker rank whose runner misbehaves at `step` (tests/integration/fault_entry.py)."""
    procs = [hc.start(model, 0, extra=("--step-timeout", timeout)),
             hc.start(model, 1, launcher=(FAULT_ENTRY, kind, str(step)), env={"MESHLM_OPENBLAS": "0"},
                      extra=("--step-timeout", timeout))]
    wait_healthy(hc.url, procs)
    return procs


def test_split_brain_is_detected_and_stops_the_cluster_loudly(model, tmp_path):
    hc = HandCluster.create(tmp_path)
    procs = faulty_worker(hc, model, "skip_step", 4, "4")
    try:
        t0 = time.monotonic()
        r = complete(hc.url, [5, 6, 7, 8], n=20, timeout=30)
        assert r.status_code == 503 and "error" in r.json()
        assert time.monotonic() - t0 < 15
        health = httpx.get(hc.url + "/health").json()
        # The leader is stuck in step 4's collective, which rank 1 skipped; at the deadline its diagnosis
        # reads rank 1's ACK of step 4 (already in) and names the split brain, not just the deadline.
        assert "split brain at step 4: rank 1" in health["error"]
        assert procs[0].wait(20) == 70  # a cluster cannot recover: the leader exits for its supervisor
    finally:
        finish(procs)


def test_hung_worker_is_ended_by_the_watchdogs(model, tmp_path):
    hc = HandCluster.create(tmp_path)
    procs = faulty_worker(hc, model, "stall_step", 3, "3")
    try:
        t0 = time.monotonic()
        r = complete(hc.url, [5, 6, 7, 8], n=20, timeout=30)
        assert r.status_code == 503
        assert time.monotonic() - t0 < 10
        assert procs[1].wait(10) == 5  # its own watchdog ends it (EXIT_DEADLINE)
        assert httpx.get(hc.url + "/health").status_code == 503
    finally:
        finish(procs)
    # which flags govern it (helper-58: a long prompt's step ended a cluster with no word of them)
    assert "--step-timeout" in hc.log(1).read_text() and "--max-tokens-per-step" in hc.log(1).read_text()


def test_a_worker_past_its_own_deadline_tells_the_leader_why(model, tmp_path):
    """A worker's step deadline that passes before the leader's (its step began sooner, or its
    --step-timeout is shorter, as here): the leader said only that the connection was reset (helper-60)."""
    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0, extra=("--step-timeout", "30")),
             hc.start(model, 1, launcher=(FAULT_ENTRY, "stall_step", "3"), env={"MESHLM_OPENBLAS": "0"},
                      extra=("--step-timeout", "3"))]
    try:
        wait_healthy(hc.url, procs)
        t0 = time.monotonic()
        r = complete(hc.url, [5, 6, 7, 8], n=20, timeout=40)
        assert r.status_code == 503 and time.monotonic() - t0 < 15
        assert "rank 1: step 3 outlived its 3 s deadline" in r.json()["error"]["message"], r.text
        assert procs[1].wait(10) == 5
    finally:
        finish(procs)


def test_a_worker_whose_leader_is_killed_mid_step_leaves_at_once(model, tmp_path):
    """Ranks on two hosts (here by hand, from a hostfile): the leader killed while rank 1 waits in a step's
    collective. Its sends fail but the wait stayed until the step's 60 s deadline (exit 5, a word about a
    deadline); the step watchdog's probe now sees the leader's connection closed and ends it (exit 3)."""
    hc = HandCluster.create(tmp_path)
    # The fault holds rank 1 inside step 3 (a collective's wait) until the leader is gone
    procs = [hc.start(model, 0),
             hc.start(model, 1, launcher=(FAULT_ENTRY, "stall_step", "3"), env={"MESHLM_OPENBLAS": "0"})]
    try:
        wait_healthy(hc.url, procs)
        def ask() -> None:
            with contextlib.suppress(httpx.HTTPError):  # its server is killed under it
                complete(hc.url, [5, 6, 7, 8], timeout=30)

        threading.Thread(target=ask, daemon=True).start()
        assert wait_until(lambda: "fault: stalling step 3" in hc.log(1).read_text(), 30), hc.log(1).read_text()[-2000:]
        procs[0].kill()
        t0 = time.monotonic()
        assert procs[1].wait(15) == 3, hc.log(1).read_text()[-2000:]
        assert time.monotonic() - t0 < 5
        assert "the leader's connection closed during step 3" in hc.log(1).read_text()
    finally:
        kill_all(procs)


def test_ranks_with_different_models_refuse_to_form_a_cluster(model, tmp_path):
    from meshlm.model.demo import make_tiny

    other = make_tiny(tmp_path / "other", "llama", layers=2, hidden=64, heads=4, kv_heads=4, seed=5)
    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0), hc.start(other, 1)]
    try:
        for p in procs:
            p.wait(90)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode != 0 and procs[0].returncode != 0
    assert "fingerprint" in hc.log(1).read_text().lower()


def test_local_cluster_secret_is_generated_and_never_shown(model, tmp_path):
    """Rank 0 makes the secret of the ranks it spawns and hands it over in their environment only."""
    srv = tp_server(model, tmp_path)
    try:
        worker = children(srv.proc.pid)[0]
        secret = process_environ(worker)["MESHLM_CLUSTER_SECRET"]
        assert re.fullmatch("[0-9a-f]{64}", secret)
        assert complete(srv.url, "hello there").status_code == 200
        for pid in (srv.proc.pid, worker):
            assert secret not in Path(f"/proc/{pid}/cmdline").read_text()
        assert secret not in srv.log.read_text()
    finally:
        stop(srv)
    assert secret not in srv.log.read_text()


def test_strangers_on_the_control_port_do_not_disturb_the_cluster(model, tmp_path):
    """During start-up: silence, garbage and a worker with the wrong secret; once up: the port is closed."""
    from meshlm.transport.auth import ClusterSecret
    from meshlm.transport.control import ControlWorker, HandshakeError

    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0)]
    impostor_error: list[BaseException] = []

    def impostor() -> None:
        w = ControlWorker("127.0.0.1", hc.control, 1, 5.0, world_size=2, connect_timeout=120,
                          secret=ClusterSecret(WRONG_SECRET))
        try:
            w.connect()
        except BaseException as e:  # recorded for the test to assert on
            impostor_error.append(e)

    try:
        wait_listening(hc.control)  # the leader binds its control port before it loads anything
        silent = socket.create_connection(("127.0.0.1", hc.control))
        garbage = socket.create_connection(("127.0.0.1", hc.control))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(300))
        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        procs.append(hc.start(model, 1))
        wait_healthy(hc.url, procs)
        thread.join(10)
        assert impostor_error and isinstance(impostor_error[0], HandshakeError)
        # Refused for its proof, or (when rank 1 proved itself first, as happens under load) because the
        # cluster formed without it: either way told why, never a bare reset.
        heard = [why for why in ("authentication failed", "stopped admitting workers") if why in str(impostor_error[0])]
        assert heard
        for stranger in (silent, garbage):
            stranger.settimeout(10)
            assert b"".join(iter(lambda s=stranger: s.recv(4096), b"")) != b""  # CHALLENGE, REJECT, then closed
            stranger.close()
        first = complete(hc.url, "the river runs")
        assert first.status_code == 200
        # The cluster formed, so the listener is gone: a later stranger is refused by the kernel.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", hc.control), timeout=2)
        assert httpx.get(hc.url + "/health").status_code == 200
        assert complete(hc.url, "the river runs").json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        finish(procs)
    leader_log = hc.log(0).read_text()
    # The leader logged the impostor's refusal with the reason the impostor heard (the wrong-secret reason
    # alone is pinned down by the next test, where no real worker races it).
    assert re.search(r"dropped connection from 127\.0\.0\.1:\d+ during the handshake: [^\n]*" + heard[0], leader_log)
    assert "bad magic" in leader_log
    assert SECRET not in leader_log and WRONG_SECRET not in leader_log and SECRET not in hc.log(1).read_text()


def test_a_rank_with_the_wrong_secret_is_refused_and_the_leader_keeps_waiting(model, tmp_path):
    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0), hc.start(model, 1, secret=WRONG_SECRET)]
    try:
        assert procs[1].wait(90) == 2  # refused at once, after its shard loaded
        worker_log = hc.log(1).read_text()
        assert "leader rejected rank 1: authentication failed" in worker_log and "secret" in worker_log
        time.sleep(1)
        assert procs[0].poll() is None  # a refused connection does not end the leader's start-up
        leader_log = hc.log(0).read_text()
        assert "waiting up to 180 s for ranks 1..1" in leader_log
        assert re.search(r"dropped connection from 127\.0\.0\.1:\d+ during the handshake: authentication "
                         r"failed", leader_log)
        with pytest.raises(httpx.ConnectError):  # and it serves nothing until every rank proved itself
            httpx.get(hc.url + "/health", timeout=2)
    finally:
        finish(procs)
    for log in (hc.log(0).read_text(), hc.log(1).read_text()):
        assert SECRET not in log and WRONG_SECRET not in log
    assert not hc.left_behind(0, 1)  # neither rank reached the join: no ring file was ever written


def test_a_rank_of_another_protocol_version_is_rejected_at_once(model, tmp_path):
    """The rank of another build fails at once, told why in its own version; the leader, which cannot tell its
    frame from a stranger's (an unproven one must not end its start: helper-61), logs the refusal at once and
    names it when its --start-timeout passes."""
    from meshlm.transport.codec import VERSION

    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0, extra=("--start-timeout", "8")),
             hc.start(model, 1, launcher=("-c", OTHER_BUILD), env={"MESHLM_OPENBLAS": "0"})]  # no re-exec
    try:
        assert procs[1].wait(30) == 2
        worker_done = time.monotonic()
        assert procs[0].wait(90) == 2
    finally:
        for p in procs:
            p.kill()
    leader_log, worker_log = hc.log(0).read_text(), hc.log(1).read_text()
    message = rf"speaks control protocol version {VERSION + 1}, this leader speaks {VERSION}"
    assert re.search(r"dropped connection from 127\.0\.0\.1:\d+ during the handshake: " + message, leader_log)
    assert re.search(r"ERROR meshlm: .*missing ranks \[1\].*127\.0\.0\.1:\d+: " + message, leader_log), \
        leader_log[-2000:]
    assert (f"speaks control protocol version {VERSION}, this build speaks {VERSION + 1}" in worker_log
            or re.search(message, worker_log)), worker_log[-2000:]
    waited = log_time(leader_log, "ERROR meshlm") - log_time(leader_log, "waiting up to 8 s")
    assert 6 < waited.total_seconds() < 20 and time.monotonic() - worker_done < 30
    assert not hc.left_behind(0, 1)


@pytest.mark.parametrize("args, words", [
    (["--tensor-parallel", "3"], ["divide", "heads"]),
    (["--tensor-parallel", "2", "--backend", "jaccl"], ["MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR"]),
    (["--tensor-parallel", "2", "--hostfile", "/nonexistent/hosts.json", "--rank", "1"], ["hostfile"]),
    # A local cluster picks its own ports: these were ignored without a word.
    (["--tensor-parallel", "2", "--control-port", "6000", "--ring-port", "6100"],
     ["--control-port and --ring-port only apply with --hostfile"]),
    (["--pipeline-parallel", "2", "--stage-port", "6200"], ["--stage-port only applies with --hostfile"]),
])
def test_bad_cluster_settings_fail_before_loading(model, args, words):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "meshlm", "serve", "--model", str(model), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    for w in words:
        assert w in r.stderr
    assert "loaded" not in r.stderr and time.monotonic() - t0 < 30


@pytest.mark.parametrize("args, words", [
    (["--control-addr", "garbage"], ["--control-addr takes HOST:PORT, got 'garbage'"]),
    (["--control-port", "70000"], ["--control-port must be in 1..65535, got 70000"]),
    (["--control-port", "-5"], ["--control-port must be in 1..65535, got -5"]),
    (["--ring-port", "70000"], ["--ring-port must be in 1..65535, got 70000"]),  # the leader waited for ever
    (["--ring-port", "65535"], ["--ring-port must be in 1..65534 (rank 1's is --ring-port + 1)"]),
    (["--pipeline-parallel", "2", "--stage-port", "70000"], ["--stage-port must be in 1..65534"]),
    (["--ips", "127.0.0.1:99999"], ["an \"ips\" entry of localhost must be an IP address (no port)"]),
    (["--control-port", "TAKEN"], ["cannot listen on 127.0.0.1:", "for the control channel: Address already in use",
                                   "choose another --control-port"]),
    (["--pipeline-parallel", "2", "--stage-port", "TAKEN"], ["rank 0 cannot listen for its stage link on 127.0.0.1:",
                                                             "Address already in use", "choose another --stage-port"]),
])
def test_bad_cluster_ports_and_addresses_fail_in_a_sentence(model, tmp_path, args, words):
    """Each of these ended in a traceback (IndexError, OverflowError, OSError) or a wait until --start-timeout,
    where the HTTP --port's mistakes are a sentence and status 2."""
    ips = args[1:2] if args[0] == "--ips" else ["127.0.0.1"]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ips}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        args = [str(taken.getsockname()[1]) if a == "TAKEN" else a for a in args if args[0] != "--ips"]
        if "--control-port" not in args:  # the default (52100) may be another test's at this moment
            args += ["--control-port", str(free_port())]
        r = subprocess.run([sys.executable, "-m", "meshlm", "serve", "--model", str(model), "--port", "0",
                            "--hostfile", str(hosts), "--start-timeout", "20", *args], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "MESHLM_CLUSTER_SECRET": "a" * 64})
    assert r.returncode == 2, r.stderr[-2000:]
    for w in words:
        assert w in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "timed out" not in r.stderr, r.stderr[-2000:]


def test_ranks_plan_within_the_smallest_kv_budget(model, tmp_path):
    """A worker with less KV memory than the leader: the leader hands out only the blocks every rank can
    hold (it learns each rank's budget in the handshake), so no plan can name a block a rank lacks."""
    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0, extra=("--kv-cache-memory", "64MiB")),
             hc.start(model, 1, extra=("--kv-cache-memory", "256KiB"))]  # 512 positions of this model a rank
    try:
        wait_healthy(hc.url, procs)
        assert "KV blocks limited to 16 by the smallest rank's --kv-cache-memory" in hc.log(0).read_text()
        r = complete(hc.url, [(7 * i) % 500 + 3 for i in range(300)], n=16)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        too_long = complete(hc.url, [5] * 600)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(hc.url + "/health").status_code == 200
    finally:
        finish(procs)


@pytest.mark.parametrize("layout", ["--tensor-parallel", "--pipeline-parallel"])
def test_a_worker_that_dies_before_the_cluster_forms_ends_the_start_with_its_name(model, tmp_path, layout):
    """Rank 1 killed as soon as it exists. Tensor parallelism: rank 0 used to wait in MLX's join for ever (it
    cannot be interrupted); a pipeline (no MLX group): its leader waited for the handshake's 180 s. Both
    now end the start within seconds, naming the rank and its status."""
    leader = subprocess.Popen([sys.executable, "-m", "meshlm", "serve", "--model", str(model), "--port",
                               str(free_port()), layout, "2", "--kv-cache-dir", str(tmp_path / "kv")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: children(leader.pid), 30, step=0.005)
        os.kill(children(leader.pid)[0], signal.SIGKILL)  # long before it can reach the group
        out, _ = leader.communicate(timeout=60)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
    assert leader.returncode == 2, out[-2000:]
    assert "rank 1 exited with status -9 before joining the cluster" in out, out[-2000:]


LAYOUTS = [("--tensor-parallel", "2"), ("--pipeline-parallel", "2")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_started_from_a_hostfile_that_dies_while_loading_ends_the_start_at_once(model, tmp_path, layout):
    """Ranks started by hand or by `meshlm launch` (no parent to watch): rank 1 answers the roll call (and
    joins the group), then is killed while it loads. The leader sees its control connection, open since the
    roll call, close (a pipeline's used to wait for the handshake's 180 s), ends the start at once and says
    why in a sentence."""
    hc = HandCluster.create(tmp_path)
    stage_port = ("--stage-port", str(free_port(avoid=hc.ring)))
    procs = [hc.start(model, 0, layout=layout, extra=stage_port),
             hc.start(model, 1, launcher=(FAULT_ENTRY, "stall_load", "3600"), env={"MESHLM_OPENBLAS": "0"},
                      layout=layout, extra=stage_port)]
    try:
        assert wait_until(lambda: "stalling the load" in hc.log(1).read_text(), 60)
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert procs[0].wait(20) == 2
        assert time.monotonic() - t0 < 5
    finally:
        kill_all(procs)
    log = hc.log(0).read_text()
    assert "rank 1 hung up before it had loaded its share" in log and "Traceback" not in log, log[-2000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_stalled_while_loading_is_named_at_the_start_deadline(model, tmp_path, layout):
    """Rank 1 joins, then stalls in its load (a stopped process or a hung disk: its kernel still answers
    the keepalives, so nothing closes). The leader loads its own share and names rank 1 once
    --start-timeout has passed. A tensor-parallel leader used to wait for ever in mlx-lm's sharded load's
    closing all_sum."""
    hc = HandCluster.create(tmp_path)
    extra = ("--stage-port", str(free_port(avoid=hc.ring)), "--start-timeout", "6")
    procs = [hc.start(model, 0, layout=layout, extra=extra),
             hc.start(model, 1, launcher=(FAULT_ENTRY, "stall_load", "3600"), env={"MESHLM_OPENBLAS": "0"},
                      layout=layout, extra=extra)]
    try:
        assert wait_until(lambda: "stalling the load" in hc.log(1).read_text(), 60)
        assert procs[0].wait(30) == 2
    finally:
        kill_all(procs)
    log = hc.log(0).read_text()
    assert "rank(s) 1 did not finish loading within 6 s of the leader" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]


@pytest.mark.parametrize("taken", [0, 1])
def test_a_rank_whose_ring_port_is_taken_says_so_and_the_other_rank_ends_at_once(model, tmp_path, taken):
    """Another process holds one rank's ring port (a cluster still running). That rank ends with a sentence
    naming the cause (status 2, no traceback). The other is in the MLX group's join (which holds the GIL)
    or waits for its LOADED: the join watcher, or that wait, sees the control connection close and ends it within
    seconds (rank 1 waited 180 s for faulthandler)."""
    hc = HandCluster.create(tmp_path)
    with socket.create_server(("127.0.0.1", hc.ring[taken])):
        procs = [hc.start(model, 0), hc.start(model, 1)]
        try:
            assert procs[taken].wait(60) == 2
            t0 = time.monotonic()
            other = procs[1 - taken].wait(30)
            assert time.monotonic() - t0 < 10
        finally:
            kill_all(procs)
    log = hc.log(taken).read_text()
    assert f"rank {taken} could not join the MLX group (ring)" in log and "another process holds" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    other_log = hc.log(1 - taken).read_text()
    if taken == 0:  # rank 1 was in its join when rank 0 ended
        assert other == -signal.SIGTERM
        assert "rank 0 hung up while the ranks joined the MLX group and loaded their shares" in other_log, other_log[-2000:]
    else:  # rank 0's join reached the port's holder; its LOADED wait or its watcher then lost rank 1
        assert (other == 2 and "rank 1 hung up before it had loaded its share" in other_log) or (
            other == -signal.SIGTERM and "rank 1 hung up while the ranks joined" in other_log), other_log[-2000:]
    assert not hc.left_behind(0, 1)  # the rank that failed its join removed its ring file; the watcher, the other's


def test_a_rank_that_exits_between_the_roll_call_and_the_join_ends_the_leaders_join(model, tmp_path):
    """Rank 1 answers the roll call, then exits just before the MLX group's join; rank 0, already in its
    join (no thread of it can run), is ended by the join watcher with the rank named, not after 180 s."""
    hc = HandCluster.create(tmp_path)
    procs = [hc.start(model, 0),
             hc.start(model, 1, launcher=(FAULT_ENTRY, "exit_before_join", "7"), env={"MESHLM_OPENBLAS": "0"})]
    try:
        assert procs[1].wait(60) == 7
        t0 = time.monotonic()
        assert procs[0].wait(30) == -signal.SIGTERM
        assert time.monotonic() - t0 < 10
    finally:
        kill_all(procs)
    log = hc.log(0).read_text()
    assert "rank 1 hung up while the ranks joined the MLX group and loaded their shares" in log, log[-2000:]
    assert not hc.left_behind(0)  # rank 1's planted exit skips its cleanup, as a crash would


FAKE_STAGE = """
import sys
from meshlm.transport import codec
from meshlm.transport.auth import ClusterSecret
from meshlm.transport.control import ControlWorker
port, secret = int(sys.argv[1]), ClusterSecret(sys.argv[2])
w = ControlWorker("127.0.0.1", port, 1, 10.0, world_size=2, secret=secret, connect_timeout=60)
w.connect()
w._send(codec.Kind.LOADED, codec.encode(codec.Loaded("whatever", -1)))  # a rank that lies about its KV
w._link.sock.settimeout(30)
while w._link.sock.recv(4096):  # the leader's REJECT, until it hangs up
    pass
"""


def test_a_rank_whose_loaded_frame_is_garbage_ends_the_start_with_a_sentence(model, tmp_path):
    """A proven rank (it holds the secret) that sends an impossible LOADED: the leader ends the start
    naming it (status 2, no traceback), as for any other misfit."""
    hc = HandCluster.create(tmp_path)
    layout = ("--pipeline-parallel", "2")
    leader = hc.start(model, 0, layout=layout, extra=("--stage-port", str(free_port(avoid=hc.ring))))
    fake = subprocess.Popen([sys.executable, "-c", FAKE_STAGE, str(hc.control), SECRET])
    try:
        assert leader.wait(60) == 2
    finally:
        kill_all((leader, fake))
    log = hc.log(0).read_text()
    assert "rank 1 says it holds -1 KV blocks" in log and "Traceback" not in log, log[-2000:]


def test_a_worker_whose_leader_dies_before_the_group_forms_exits_and_says_why(model, tmp_path):
    """Rank 0 killed as soon as its worker exists: the worker (which shares its output) stops dialling rank
    0 instead of waiting out its deadline, and removes the cluster's directory rank 0 can no longer remove."""
    leader = subprocess.Popen([sys.executable, "-m", "meshlm", "serve", "--model", str(model), "--port",
                               str(free_port()), "--tensor-parallel", "2", "--kv-cache-dir", str(tmp_path / "kv")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = None

    def execed_worker() -> list[str]:  # the worker's command line, once it has exec'd (a fork has rank 0's)
        for pid in children(leader.pid):
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                if "--ring-hostfile" in args:
                    return [str(pid), *args]
        return []

    try:
        assert wait_until(execed_worker, 30, step=0.005)
        pid, *args = execed_worker()
        worker, directory = int(pid), Path(args[args.index("--ring-hostfile") + 1]).parent
        os.kill(leader.pid, signal.SIGKILL)
        out, _ = leader.communicate(timeout=60)  # the pipe closes once the worker has exited too
    finally:
        for pid in [leader.pid, worker]:
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "rank 0 ended before the cluster formed" in out, out[-2000:]
    assert wait_until(lambda: not alive(worker), 10) and not directory.exists()


def test_sigterm_during_a_step_longer_than_3_s_stops_the_workers_in_order(model, tmp_path):
    """The engine's stop waited 3 s for the step in flight, then closed the control channel under it: the
    worker, in the step's collectives, logged that the leader's connection closed (its process died) and exited 3, after
    an orderly stop the leader had sent (review helper-43). The step is waited for now."""
    import threading

    srv = ServerProcess(model, "--max-model-len", "512", "--tensor-parallel", "2", log_dir=tmp_path,
                        entry=fault_entry("slow_prefill", 9), env={"MESHLM_OPENBLAS": "0"})
    try:
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(httpx.post(
            srv.url + "/v1/completions", timeout=60, json={"prompt": "the river runs past the old mill " * 8,
                                                            "max_tokens": 4, "temperature": 0})))
        t.start()
        time.sleep(1.5)  # inside the 9 s step: the drain's 2 s grace and 3 s more end before it does
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log.read_text()[-2000:]
        t.join(30)
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert "the leader's connection closed" not in log, log[-2000:]
    assert answer and answer[0].status_code in (200, 503), answer
