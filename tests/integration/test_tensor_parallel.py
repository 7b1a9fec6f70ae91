"""Tensor parallelism with real ranks: parity with one process, endurance, and every failure mode."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import (SCORE_TOL, ServerProcess, assert_scores, children, free_port, healthy, reference_scores, score_all,
                      scored_prompts, stream_error, stream_then)

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not reaped it yet.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tp") / "tiny-kv4", "llama", layers=2, hidden=64, heads=4, kv_heads=4)


def start(model, tmp_path, *args) -> ServerProcess:
    return ServerProcess(model, "--max-model-len", "512", *args, log_dir=tmp_path)


async def _complete_all(url: str, prompts: list[str], n: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 1}) for p in prompts])
    return [r.json() for r in rs]


PROMPTS = [f"prompt {i}: " + "the river runs past the old mill " * (i % 4 + 1) for i in range(16)]


@pytest.fixture(scope="module")
def single_reference(tp_model, tmp_path_factory):
    srv = start(tp_model, tmp_path_factory.mktemp("tp1"), "--no-prefix-cache")
    try:
        yield asyncio.run(_complete_all(srv.url, PROMPTS, 16))
    finally:
        srv.stop()


# Local ranks sum through shared memory by default (transport/local_reduce.py); "off" keeps MLX's ring.
@pytest.mark.parametrize("tp,sums", [(2, "auto"), (4, "auto"), (2, "off")], ids=["tp2", "tp4", "tp2-ring"])
def test_tp_greedy_parity_with_single_process(tp_model, single_reference, tmp_path, tp, sums):
    from meshlm.transport.local_reduce import native_module

    srv = start(tp_model, tmp_path, "--tensor-parallel", str(tp), "--local-all-reduce", sums)
    try:
        got = asyncio.run(_complete_all(srv.url, PROMPTS, 16))
        scores = asyncio.run(score_all(srv.url, scored_prompts()))
        shared = sums == "auto" and native_module()[0] is not None
        assert ("tensor-parallel sums: shared memory" in srv.log.read_text()) == shared
        if shared:  # every rank took part in every sum (two per layer per step), the workers' in their acks
            counts = [srv.metric(f'meshlm_all_reduce_total{{rank="{r}"}}') for r in range(tp)]
            assert counts[0] >= 2 * 2 * 16 and all(c > 0 for c in counts), counts
            for r in range(tp):
                waiting = srv.metric(f'meshlm_all_reduce_seconds_total{{part="waiting",rank="{r}"}}')
                assert 0 <= waiting <= srv.metric(f'meshlm_all_reduce_seconds_total{{part="total",rank="{r}"}}')
    finally:
        srv.stop()
    assert [g["choices"][0]["text"] for g in got] == [r["choices"][0]["text"] for r in single_reference]
    # Logprobs of the chosen tokens agree within 1e-4 (the sharded sums differ only in rounding).
    for g, r in zip(got, single_reference):
        a, b = g["choices"][0]["logprobs"]["token_logprobs"], r["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert_scores(scores, reference_scores(tp_model, scored_prompts()), tol=SCORE_TOL)  # the prompts' own logprobs


def test_fused_decode_on_real_ranks_serves_the_module_paths_logprobs_exactly(tp_model, tmp_path):
    """Each rank runs a decode step's layers fused and cut at the two sums (model/decode_layer.py): the
    same sums of the same partial outputs, so the same logprobs bit for bit as `--no-fused-decode`. One
    request at a time, so both servers batch alike."""
    answers, logs = [], []
    for flags in ((), ("--no-fused-decode",)):
        srv = start(tp_model, tmp_path, "--tensor-parallel", "2", "--no-prefix-cache", *flags)
        try:
            answers.append([asyncio.run(_complete_all(srv.url, [p], 12))[0] for p in PROMPTS[:4]])
        finally:
            srv.stop()
        logs.append(srv.log.read_text())
    assert [log.count("one node each and two sums") for log in logs] == [2, 0]
    for got, want in zip(*answers):
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["logprobs"]["token_logprobs"] == want["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A tiny model whose LM head is its embedding table, and one process's answers."""
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("tp") / "tiny-tied", "llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      tied=True)
    srv = start(model, tmp_path_factory.mktemp("tied1"), "--no-prefix-cache")
    try:
        return model, asyncio.run(_complete_all(srv.url, PROMPTS, 16))
    finally:
        srv.stop()


@pytest.mark.parametrize("sums", ["auto", "off"], ids=["shared-memory", "ring"])
def test_a_tied_head_split_by_vocabulary_matches_one_process(tied, tmp_path, sums):
    """Each rank multiplies by half the tied table's rows and the slices are summed: the text of one process,
    logprobs within 1e-4."""
    model, reference = tied
    srv = start(model, tmp_path, "--tensor-parallel", "2", "--local-all-reduce", sums)
    try:
        got = asyncio.run(_complete_all(srv.url, PROMPTS, 16))
    finally:
        srv.stop()
    assert srv.log.read_text().count("the LM head is split by vocabulary over 2 ranks") == 2
    assert [g["choices"][0]["text"] for g in got] == [r["choices"][0]["text"] for r in reference]
    for g, r in zip(got, reference):
        a, b = g["choices"][0]["logprobs"]["token_logprobs"], r["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.fixture()
def tp2(tp_model, tmp_path):
    srv = start(tp_model, tmp_path, "--tensor-parallel", "2", "--worker-timeout", "3")
    yield srv
    srv.stop()
    for pid in children(srv.proc.pid):
        os.kill(pid, signal.SIGKILL)


def _rank_seconds(srv) -> dict[tuple[str, str], float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {(m.group(2), m.group(1)): float(m.group(3)) for m in re.finditer(
        r'^meshlm_rank_seconds_total\{phase="(\w+)",rank="(\d+)"\} (\S+)$', text, re.M)}


def test_endurance_sequential_concurrent_and_no_kv_growth(tp2):
    # The worker's series exist before its first step (they appeared with its first ACK: review helper-55)
    assert _rank_seconds(tp2)[("1", "wait")] == 0
    with httpx.Client(base_url=tp2.url, timeout=120) as c:
        for i in range(100):
            r = c.post("/v1/completions", json={"prompt": f"seq {i}", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    results = asyncio.run(_complete_all(tp2.url, [f"concurrent {i}" for i in range(64)], 4))
    assert all(r["usage"]["completion_tokens"] == 4 for r in results)
    assert wait_until(lambda: tp2.metric("meshlm_kv_blocks_used") == 0, 10)
    # Every rank's step time by phase reaches rank 0's /metrics, the worker's through its ACKs.
    seconds = _rank_seconds(tp2)
    for rank in ("0", "1"):
        assert seconds[(rank, "build")] > 0 and seconds[(rank, "device")] > 0, seconds
    assert seconds[("0", "sample")] > 0 and seconds[("1", "wait")] > 0, seconds
    # An idle leader is no step work to wait for: 2.5 s idle, then one request, adds well under 1 s to the
    # worker's wait (it counted every idle second there: review helper-55)
    time.sleep(2.5)
    assert httpx.post(tp2.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200
    assert _rank_seconds(tp2)[("1", "wait")] - seconds[("1", "wait")] < 1.0


def test_cancel_mid_stream_cleans_every_rank(tp2):
    req = {"prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=tp2.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=req) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
    assert wait_until(lambda: tp2.metric("meshlm_batch_size") == 0 and tp2.metric("meshlm_kv_blocks_used") == 0, 10)
    # Every rank applied the removal: the next request's plan fingerprint check passes on all ranks.
    r = httpx.post(tp2.url + "/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_kill_worker_mid_generation_fails_requests_and_health_names_rank(tp2, sig):
    # A stopped worker (or a host that stopped answering) closes nothing: its missing heartbeats tell,
    # within --worker-timeout (3 s here), not at the 60 s step deadline.
    worker = children(tp2.proc.pid)[0]
    t0 = time.monotonic()
    lines = stream_then(tp2.url, lambda: os.kill(worker, sig))
    assert time.monotonic() - t0 < 10
    assert lines[-1] == "data: [DONE]"
    health = httpx.get(tp2.url + "/health")
    assert health.status_code == 503 and "worker rank 1 lost" in health.json()["error"], health.json()
    # The client is told the cause /health names, not the collective's symptom ("peer lost").
    assert health.json()["error"] in stream_error(lines), (stream_error(lines), health.json())
    r = httpx.post(tp2.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503  # documented: unhealthy at once, the leader exits 70 five seconds later
    # A lost rank is a known failure (the shared-memory sum's "peer lost" included), logged in a line.
    assert "Traceback" not in tp2.log.read_text(), tp2.log.read_text()[-3000:]


def test_kill_leader_makes_workers_exit(tp2):
    worker = children(tp2.proc.pid)[0]
    tp2.proc.kill()
    tp2.proc.wait()
    assert wait_until(lambda: not alive(worker), 10)


@contextlib.contextmanager
def process_group(cmd: list[str], log: Path, **env: str):
    """`cmd` in a process group of its own (a terminal's), killed with whatever it started if a test fails."""
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **env})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> int:
    """Send `sig` to the whole group (as Ctrl-C does); rank 0's status, once every worker it started is gone."""
    workers = children(proc.pid)
    os.killpg(proc.pid, sig)
    code = proc.wait(20)
    assert all(wait_until(lambda: not alive(w), 10) for w in workers)
    return code


@pytest.mark.parametrize("layout, sig", [(("--tensor-parallel", "2"), signal.SIGINT),
                                         (("--pipeline-parallel", "2"), signal.SIGTERM)])
def test_a_signal_to_the_whole_process_group_is_an_orderly_stop(tp_model, tmp_path, layout, sig):
    """The terminal's Ctrl-C (or a service manager's SIGTERM to the group) reaches rank 0 and the workers it
    started at once. Rank 0 drains and stops them: status 0. A worker that ended at the signal itself made
    that stop a failure (rank 0: 'worker rank 1 lost', status 70; the worker: a KeyboardInterrupt traceback)."""
    port, log = free_port(), tmp_path / "group.log"
    cmd = [sys.executable, "-m", "meshlm", "serve", "--model", str(tp_model), "--port", str(port), "--kv-cache-dir",
           str(tmp_path / "kv"), "--max-model-len", "512", *layout]
    with process_group(cmd, log) as proc:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: healthy(url), 120), log.read_text()[-3000:]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert signal_group(proc, sig) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "lost" not in text and "Traceback" not in text and "ERROR" not in text, text[-3000:]
    assert f"rank 1: {sig.name}: rank 0 stops the cluster" in text, text[-3000:]


@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["ctrl-c", "sigterm-rank-0", "sigterm-group"])
def test_a_stop_while_the_cluster_starts_is_one_line_and_leaves_nothing(tp_model, tmp_path, sig, to_group):
    """Ctrl-C before serving began (here while both ranks import: rank 0 starts its worker first) used to
    print a KeyboardInterrupt traceback from every rank. Each says 'interrupted' and exits 130, and the
    local cluster's directory goes with them. (Inside the MLX join the join watcher ends the ranks instead:
    test_join_watch.py.) SIGTERM then (a service manager's stop: to rank 0 alone, or to the group) ended
    each process it reached on the spot: nothing said, the directory left behind, and a rank 0 stopped
    alone left its worker to find it gone. It now does what Ctrl-C does."""
    log, tmp = tmp_path / "start.log", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "meshlm", "serve", "--model", str(tp_model), "--port", str(free_port()),
           "--kv-cache-dir", str(tmp_path / "kv"), "--tensor-parallel", "2"]
    with process_group(cmd, log, TMPDIR=str(tmp)) as proc:
        # Each rank logs its BLAS (found or not) before it imports mlx-lm; rank 0 then imports for ~1 s
        # before its roll call, and the join comes after that.
        assert wait_until(lambda: log.read_text().count("OpenBLAS") == 2, 60, step=0.01), log.read_text()
        workers = children(proc.pid)
        assert workers and list(tmp.iterdir())  # the worker runs, the cluster's directory exists
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(20) == 130, log.read_text()[-3000:]
        assert all(wait_until(lambda: not alive(w), 10) for w in workers)
    text = log.read_text()
    assert "Traceback" not in text and "ERROR meshlm: interrupted" in text, text[-3000:]
    # the ranks share the terminal: a worker's lines say which rank wrote them, rank 0's stay as one server's
    assert re.search(r"^\S+ \S+ rank 1 INFO meshlm\.platform: using OpenBLAS", text, re.M), text[-3000:]
    assert re.search(r"^\S+ \S+ INFO meshlm\.platform: using OpenBLAS", text, re.M), text[-3000:]
    assert not list(tmp.iterdir())


def test_sigterm_on_leader_stops_every_rank_within_5s(tp2):
    workers = children(tp2.proc.pid)
    stream = subprocess.Popen(["curl", "-sN", tp2.url + "/v1/completions", "-d",
                               '{"prompt": "x", "max_tokens": 500, "stream": true, "ignore_eos": true}'],
                              stdout=subprocess.PIPE)
    time.sleep(0.5)
    t0 = time.monotonic()
    tp2.proc.send_signal(signal.SIGTERM)
    assert tp2.proc.wait(10) == 0  # an orderly stop, not the re-raised signal
    assert all(wait_until(lambda: not alive(w), 5 - (time.monotonic() - t0)) for w in workers)
    assert time.monotonic() - t0 < 5
    out = stream.communicate(timeout=5)[0].decode()
    assert out.rstrip().endswith("data: [DONE]")
