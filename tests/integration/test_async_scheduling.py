"""Asynchronous scheduling (`--async-scheduling on`: each decode step planned and launched on the previous
step's tokens while they are still on the device) in a real server, against the same server planning
every step after reading the tokens (`off`): greedy text and logprobs, seeded sampling with penalties,
stop strings, EOS, n > 1, streaming and usage through the official client, arrivals while others
decode, an abort mid-stream. The metric proves the steps really were planned ahead. Under tensor
parallelism the workers get each plan made ahead before its ids, which follow once sampled: the same
parity with one process, and a worker lost meanwhile ends the requests within seconds."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, assert_parity, children, complete_all, stream_error, stream_then

pytestmark = pytest.mark.slow

AHEAD = "meshlm_steps_planned_ahead_total"


def _prompts(n: int = 16) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(2, 70))] for _ in range(n)]


def _server(model, factory, name: str, *args: str):
    srv = ServerProcess(model, "--max-model-len", "512", *args, log_dir=factory.mktemp(name))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sync(tiny_model, tmp_path_factory):
    yield from _server(tiny_model, tmp_path_factory, "sync", "--async-scheduling", "off")


@pytest.fixture(scope="module")
def ahead(tiny_model, tmp_path_factory):
    yield from _server(tiny_model, tmp_path_factory, "ahead", "--async-scheduling", "on", "--block-size", "16")


async def _staggered(url: str, prompts, body: dict) -> list[dict]:
    """Requests arriving one after another while earlier ones decode, each with its own max_tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def one(i, p):
            await asyncio.sleep(0.02 * i)
            return await c.post("/v1/completions", json={"prompt": p, "max_tokens": 8 + 3 * i, **body})
        rs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json() for r in rs]


def test_greedy_text_and_logprobs_equal_planning_each_step_after_the_last(sync, ahead):
    before = ahead.metric(AHEAD)
    want = asyncio.run(complete_all(sync.url, _prompts(), 40))
    got = asyncio.run(complete_all(ahead.url, _prompts(), 40))
    assert_parity(got, want)
    # Token counts, not cached_tokens: prefix hits between these concurrent prompts depend on arrival
    # order and on the block size, which the two servers set differently.
    counts = ("prompt_tokens", "completion_tokens")
    assert [[g["usage"][k] for k in counts] for g in got] == [[w["usage"][k] for k in counts] for w in want]
    assert ahead.metric(AHEAD) - before > 15  # fewer than the ~40 steps: a step saving blocks to SSD is planned in full
    body = {"temperature": 0, "logprobs": 2}
    assert_parity(asyncio.run(_staggered(ahead.url, _prompts(), body)),
                  asyncio.run(_staggered(sync.url, _prompts(), body)))


def test_seeded_sampling_with_penalties_draws_the_same_tokens(sync, ahead):
    body = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "presence_penalty": 0.5, "frequency_penalty": 0.3,
            "repetition_penalty": 1.1, "logit_bias": {"17": 3.0}, "logprobs": 1}

    def run(srv):
        return [r["choices"][0]["text"] for r in asyncio.run(_staggered(srv.url, [
            p for p in _prompts(8)], {**body, "seed": 1234}))]

    texts = run(ahead)
    assert texts == run(sync)
    assert len(set(texts)) > 1


def test_stop_strings_eos_n_streaming_and_usage_through_the_client(sync, ahead):
    prompt = [7, 8, 9, 10] * 6
    plain = httpx.post(sync.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    results = []
    for srv in (sync, ahead):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop], n=2,
                                      extra_body={"ignore_eos": True})
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        eos = client.completions.create(model=model, prompt=_prompts()[3], max_tokens=300, temperature=0)
        results.append(([c.text for c in r.choices], [c.finish_reason for c in r.choices],
                        "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens,
                        eos.choices[0].text, eos.choices[0].finish_reason, eos.usage.completion_tokens))
    assert results[0] == results[1]
    assert results[1][0] == [plain[: plain.index(stop)]] * 2 and results[1][1] == ["stop", "stop"]


def test_an_abort_mid_stream_leaves_the_server_serving(sync, ahead):
    async def abort_one():
        async with httpx.AsyncClient(base_url=ahead.url, timeout=30) as c:
            req = {"prompt": "go", "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=req) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += bool(line)
                    if n == 10:
                        break  # the client goes away mid-stream
    asyncio.run(abort_one())
    want = asyncio.run(complete_all(sync.url, _prompts(4), 16))
    assert_parity(asyncio.run(complete_all(ahead.url, _prompts(4), 16)), want)
    assert httpx.get(ahead.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Eight layers: a forward of more ops than MLX's CPU stream queues ahead, so its launch returns only
    near its end (runner.py) and waits in the forward's sums meanwhile."""
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("deep") / "deep", "llama", layers=8, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def deep_sync(deep_model, tmp_path_factory):
    yield from _server(deep_model, tmp_path_factory, "deep-sync", "--async-scheduling", "off")


@pytest.fixture(scope="module")
def tp_ahead(deep_model, tmp_path_factory):
    yield from _server(deep_model, tmp_path_factory, "tp-ahead", "--async-scheduling", "on", "--tensor-parallel", "2",
                       "--worker-timeout", "3")


def test_tensor_parallel_plans_ahead_with_the_ids_following(deep_sync, tp_ahead):
    """Two ways this hung until the step deadline while building it: the draw first evaluated inside the
    next step's forward (reading the ids waited for that forward, which waited in its first sum for the
    worker, which waited for the ids), and the ids sent only after the launch of the forward that takes
    them (on the CPU the launch returns near the forward's end, so the same circle)."""
    before = tp_ahead.metric(AHEAD)
    body = {"temperature": 0, "logprobs": 2}
    assert_parity(asyncio.run(_staggered(tp_ahead.url, _prompts(), body)),
                  asyncio.run(_staggered(deep_sync.url, _prompts(), body)), tol=1e-4)
    assert tp_ahead.metric(AHEAD) - before > 15
    seeded = {"temperature": 0.9, "top_p": 0.9, "presence_penalty": 0.5, "seed": 99}

    def texts(srv):
        return [r["choices"][0]["text"] for r in asyncio.run(_staggered(srv.url, _prompts(8), seeded))]

    assert texts(tp_ahead) == texts(deep_sync)


def test_a_worker_killed_while_steps_are_planned_ahead_ends_the_requests(tp_ahead):
    worker = children(tp_ahead.proc.pid)[0]
    t0 = time.monotonic()
    lines = stream_then(tp_ahead.url, lambda: os.kill(worker, signal.SIGKILL), after=20)
    assert time.monotonic() - t0 < 10
    assert lines[-1] == "data: [DONE]" and "worker rank 1 lost" in stream_error(lines), lines[-3:]
    assert "Traceback" not in tp_ahead.log.read_text(), tp_ahead.log.read_text()[-3000:]
