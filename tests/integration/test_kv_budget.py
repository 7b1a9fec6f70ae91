"""--kv-cache-memory bounds the KV bytes a real server allocates, whatever the mix of lengths (issue 11):
one long prompt and fifteen short ones at once, the gauge sampled throughout, the text unchanged."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow

BUDGET = 1 << 20  # the tiny model's KV is 512 bytes a position: 2,048 positions, 64 blocks of 32


async def _complete_all(url: str, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for p in prompts])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json()["choices"][0]["text"] for r in rs]


def test_one_long_and_fifteen_short_stay_within_the_budget(tiny_model, tmp_path):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(1400)]] + [[rng.randrange(3, 500) for _ in range(6)]
                                                                  for _ in range(15)]
    roomy = ServerProcess(tiny_model, "--max-model-len", "2048", "--no-prefix-cache", log_dir=tmp_path)
    try:
        want = asyncio.run(_complete_all(roomy.url, prompts))
    finally:
        roomy.stop()
    tight = ServerProcess(tiny_model, "--max-model-len", "2048", "--no-prefix-cache", "--kv-cache-memory",
                          str(BUDGET), log_dir=tmp_path)
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(tight.metric("meshlm_kv_cache_bytes"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        sampler.start()
        got = asyncio.run(_complete_all(tight.url, prompts))
        done.set()
        sampler.join()
        assert got == want  # preemption or not, the same greedy text
        assert max(samples) <= BUDGET and max(samples) > BUDGET // 4, (max(samples), BUDGET)
        assert "KV budget: 64 blocks of 32 tokens" in tight.log.read_text()
    finally:
        done.set()
        tight.stop()
