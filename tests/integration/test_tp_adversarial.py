"""The adversarial cases of tensor-parallel serving (reference §P8.7.1), each with real ranks.

Deadlock, token mismatch and partial failure (a killed worker) live in
test_tensor_parallel.py; this file covers the rest.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess, free_port, free_port_run
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


def test_split_brain_is_detected_and_stops_the_cluster_loudly(model, tmp_path):
    srv = tp_server(model, tmp_path, "--step-timeout", "10", env={"MESHLM_FAULT_INJECT": "skip_step=4"})
    try:
        t0 = time.monotonic()
        r = complete(srv.url, "a worker will miss step four", n=20, timeout=30)
        assert r.status_code == 503 and "error" in r.json()
        assert time.monotonic() - t0 < 15
        health = httpx.get(srv.url + "/health").json()
        assert "rank 1" in health["error"] or "split brain" in health["error"]
    finally:
        stop(srv)


def test_hung_worker_is_ended_by_the_watchdogs(model, tmp_path):
    srv = tp_server(model, tmp_path, "--step-timeout", "3", env={"MESHLM_FAULT_INJECT": "stall_step=3"})
    worker = children(srv.proc.pid)[0]
    try:
        t0 = time.monotonic()
        r = complete(srv.url, "a worker will hang", n=20, timeout=30)
        assert r.status_code == 503
        assert time.monotonic() - t0 < 10
        assert wait_until(lambda: not alive(worker), 10)  # its own watchdog ends it
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        stop(srv)


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
    names = [sorted(p.name for p in d.iterdir()) for d in rank_dirs]
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
    for f in r0.iterdir():
        (r1 / f.name).write_bytes(f.read_bytes())
    srv = tp_server(model, tmp_path)
    try:
        r = complete(srv.url, prompt)
        health = httpx.get(srv.url + "/health").json()
    finally:
        stop(srv)
    assert first["usage"]["completion_tokens"] == 8
    # Rank 1 dropped the foreign files, so it lacks blocks rank 0 offers: the cluster refuses
    # to compute with wrong or missing KV, and says which rank and why.
    assert r.status_code == 503
    assert "rank 1" in health["error"] and "not cached on this rank" in health["error"]


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
        assert wait_until(lambda: srv.metric("meshlm_kv_cache_bytes") == 0, 10)
        # Every step's ACK carries the worker's own batch fingerprint: a leaked sequence would be a split brain.
        assert httpx.get(srv.url + "/health").status_code == 200
        assert rss_kb(worker) - base < 64 * 1024
    finally:
        stop(srv)


def test_ranks_with_different_models_refuse_to_form_a_cluster(model, tmp_path):
    from meshlm.model.demo import make_tiny

    other = make_tiny(tmp_path / "other", "llama", layers=2, hidden=64, heads=4, kv_heads=4, seed=5)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    ring = free_port_run(2)  # rank r listens on ring[r]: no other port of this test may land there
    common = ["--hostfile", str(hosts), "--tensor-parallel", "2", "--ring-port", str(ring[0]),
              "--control-port", str(free_port(avoid=ring)), "--kv-cache-dir", str(tmp_path / "kv")]
    procs = [subprocess.Popen([sys.executable, "-m", "meshlm", "serve", "--model", str(m), "--rank", str(r),
                               "--port", str(free_port(avoid=ring)), *common], stderr=subprocess.PIPE)
             for r, m in ((1, other), (0, model))]
    try:
        errs = [p.communicate(timeout=90)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode != 0 and procs[0].returncode != 0
    assert "fingerprint" in errs[1].lower()


@pytest.mark.parametrize("args, words", [
    (["--tensor-parallel", "3"], ["divide", "heads"]),
    (["--tensor-parallel", "2", "--backend", "jaccl"], ["MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR"]),
    (["--tensor-parallel", "2", "--hostfile", "/nonexistent/hosts.json", "--rank", "1"], ["hostfile"]),
])
def test_bad_cluster_settings_fail_before_loading(model, args, words):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "meshlm", "serve", "--model", str(model), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    for w in words:
        assert w in r.stderr
    assert "loaded" not in r.stderr and time.monotonic() - t0 < 30
