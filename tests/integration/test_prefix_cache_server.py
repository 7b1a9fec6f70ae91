"""The prefix cache behind a real server: cached answers equal uncached ones, in every tier and failure.

Every greedy answer is compared with a server started with --no-prefix-cache
(same model, same flags otherwise). Prompts are token-id lists sent to
/v1/completions, so block arithmetic is exact (block size 16), except for the
multi-turn chat. Block files are located by computing their keys the way the
server does (model fingerprint, dtype, layout, block size).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import stat
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from conftest import ServerProcess
from meshlm.kv.blockfile import checksum
from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.kv.store import BlockData as Block, KVShape
from meshlm.kv.ssd import LOW_WATER, RESCAN_FRACTION, SUFFIX, TMP_DIR, SSDConfig, SSDTier
from meshlm.model.loader import model_fingerprint

pytestmark = pytest.mark.slow

BS = 16
VOCAB = 400  # ids every tiny model knows
FLAGS = ("--max-tokens-per-step", "64", "--block-size", str(BS))  # prompts prefilled in several chunks
RAM = 'meshlm_prefix_cache_bytes{tier="ram"}'
SSD = 'meshlm_prefix_cache_bytes{tier="ssd"}'
HITS_RAM = 'meshlm_prefix_cache_hits_total{tier="ram"}'
HITS_SSD = 'meshlm_prefix_cache_hits_total{tier="ssd"}'
QUERY_TOKENS = "meshlm_prefix_cache_query_tokens_total"
HIT_TOKENS = "meshlm_prefix_cache_hit_tokens_total"
EVICTIONS_RAM = 'meshlm_prefix_cache_evictions_total{tier="ram"}'
EVICTIONS_SSD = 'meshlm_prefix_cache_evictions_total{tier="ssd"}'
DROPPED = "meshlm_prefix_cache_ssd_dropped_total"


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def complete(srv: ServerProcess, prompt: list[int], max_tokens: int = 8, timeout: float = 120) -> dict:
    r = httpx.post(srv.url + "/v1/completions", timeout=timeout,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    return body


def chat(srv: ServerProcess, messages: list[dict], max_tokens: int = 12) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for(predicate, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def salt_of(model: Path) -> CacheSalt:
    return CacheSalt(model_fingerprint(model), "float32", "tp1", BS)


def block_file(kv_dir: Path, model: Path, prompt: list[int], index: int) -> Path:
    salt = salt_of(model)
    key = block_keys(prompt, salt)[index]
    return kv_dir / salt.model_fingerprint / salt.directory / "rank_0" / (key.hex() + SUFFIX)


@pytest.fixture(scope="module")
def tiny_model_b(tmp_path_factory) -> Path:
    """Same architecture and tokenizer as `tiny_model`, other weights (another model's salt)."""
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-b") / "tiny-llama-b", "llama", layers=2, hidden=64, heads=4,
                     kv_heads=2, seed=1)


@pytest.fixture(scope="module")
def plain(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, "--no-prefix-cache", *FLAGS, log_dir=tmp_path_factory.mktemp("plain"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(plain):
    """Greedy answer without any cache (memoised)."""
    memo: dict = {}

    def answer(prompt: list[int] | list[dict], max_tokens: int | None = None) -> str:
        key = repr((prompt, max_tokens))
        if key not in memo:
            chat_style = isinstance(prompt[0], dict)
            body = (chat(plain, prompt, max_tokens or 12) if chat_style
                    else complete(plain, prompt, max_tokens or 8))
            assert cached(body) == 0
            memo[key] = text(body)
        return memo[key]

    return answer


@pytest.fixture(scope="module")
def warm(tiny_model, tmp_path_factory):
    srv = ServerProcess(tiny_model, *FLAGS, log_dir=tmp_path_factory.mktemp("warm"))
    yield srv
    srv.stop()


# -- greedy output with the cache equals output without it ---------------------------


def test_plain_server_has_no_prefix_cache(plain):
    assert "meshlm_prefix_cache" not in httpx.get(plain.url + "/metrics").text


def test_repeated_prompt_hits_every_full_block(warm, reference):
    prompt = ids(5 * BS + 3, seed=1)
    hits = warm.metric(HITS_RAM)
    queried, served = warm.metric(QUERY_TOKENS), warm.metric(HIT_TOKENS)
    first, second = complete(warm, prompt), complete(warm, prompt)
    assert cached(first) == 0
    assert cached(second) == 5 * BS
    assert warm.metric(HITS_RAM) - hits >= 5
    # In tokens, as vLLM's prefix_cache_queries/hits: their ratio is the hit rate usage shows (review helper-45)
    assert warm.metric(QUERY_TOKENS) - queried == 2 * len(prompt) and warm.metric(HIT_TOKENS) - served == 5 * BS
    assert text(first) == text(second) == reference(prompt)
    assert warm.metric(RAM) > 0


def test_a_cache_salt_shares_prefix_blocks_only_among_requests_giving_it(warm, reference):
    """vLLM's cache_salt was ignored as an unknown field: every tenant's prompts shared one prefix cache,
    so one could tell from another's time to first token what it had asked."""
    prompt = ids(4 * BS + 5, seed=77)

    def salted(salt: str | None) -> dict:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        r = httpx.post(warm.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first, again, other, plain = salted("tenant-a"), salted("tenant-a"), salted("tenant-b"), salted(None)
    assert [cached(b) for b in (first, again, other, plain)] == [0, 4 * BS, 0, 0]
    assert cached(salted(None)) == 4 * BS  # the unsalted chain is a tenant of its own
    assert {text(b) for b in (first, again, other, plain)} == {reference(prompt)}
    r = httpx.post(warm.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    # /v1/responses passes it on (it was dropped there: a salted response read the unsalted chain)
    question = " ".join(f"word{i}" for i in range(120))

    def response(salt: str) -> int:  # salted only: an unsalted chat here would lend blocks to later tests' chats
        body = {"input": question, "max_output_tokens": 2, "cache_salt": salt}
        r = httpx.post(warm.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert [response("tenant-r"), response("tenant-r") > 0, response("tenant-s")] == [0, True, 0]


def test_exact_block_multiple_recomputes_only_the_last_token(warm, reference):
    prompt = ids(4 * BS, seed=2)
    complete(warm, prompt)
    again = complete(warm, prompt)
    # The last token's logits must be computed: 3 whole blocks and 15 tokens lent by the fourth.
    assert cached(again) == 4 * BS - 1
    assert text(again) == reference(prompt)


@pytest.mark.parametrize("make, want", [
    (lambda base: base[: 2 * BS + 7] + ids(9, seed=31), 2 * BS + 7),  # 2 blocks and 7 tokens of a third
    (lambda base: base[: BS - 1] + ids(30, seed=32), BS - 1),  # one token short of a block
    (lambda base: base[: 3 * BS], 3 * BS - 1),  # exactly the first 3 blocks: the last token is recomputed
    (lambda base: base + ids(20, seed=33), 3 * BS),  # the whole prompt and more (its tail is no full block)
], ids=["shares_2_blocks_and_a_partial_one", "shares_less_than_a_block", "is_its_first_3_blocks",
        "extends_it"])
def test_partial_prefix_hits(warm, reference, make, want):
    base = ids(3 * BS + 5, seed=3)  # not a block multiple
    assert text(complete(warm, base)) == reference(base)
    prompt = make(base)
    body = complete(warm, prompt)
    assert cached(body) == want
    assert text(body) == reference(prompt)


def test_multi_turn_chat_reuses_the_first_turn(warm, reference):
    turn1 = [
        {"role": "system", "content": "You are a careful assistant. Answer in one short sentence. " * 4},
        {"role": "user", "content": "What is the capital of France, and why is it famous?"},
    ]
    r1 = chat(warm, turn1)
    assert cached(r1) == 0
    assert text(r1) == reference(turn1)
    turn2 = turn1 + [{"role": "assistant", "content": text(r1)},
                     {"role": "user", "content": "And the capital of Germany?"}]
    r2 = chat(warm, turn2)
    p1 = r1["usage"]["prompt_tokens"]
    assert cached(r2) > 0
    assert cached(r2) >= p1 // BS * BS  # at least every full block of turn 1's prompt
    assert cached(r2) < r2["usage"]["prompt_tokens"]
    assert text(r2) == reference(turn2)
    # Turn 3, streamed: the usage chunk reports the cached prefix as well.
    turn3 = turn2 + [{"role": "assistant", "content": text(r2)}, {"role": "user", "content": "Thanks!"}]
    events = []
    with httpx.stream("POST", warm.url + "/v1/chat/completions", timeout=120, json={
            "messages": turn3, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cached(r2)
    assert streamed == reference(turn3)


def test_a_batched_completions_cached_tokens_are_the_sum_over_its_prompts(warm):
    """usage's cached_tokens took the largest of all choices: a batch of two cached prompts reported one's
    (review helper-55). Per prompt what all its n choices found, summed over prompts, as prompt_tokens is;
    a fresh prompt's is 0, though its later choices found the blocks the first one wrote (it said the
    prompt's length less one: helper-58)."""
    a, b = ids(3 * BS + 1, seed=901), ids(2 * BS + 5, seed=902)
    complete(warm, a), complete(warm, b)
    r = httpx.post(warm.url + "/v1/completions", timeout=120, json={
        "prompt": [a, b], "n": 2, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(a) + len(b)
    assert cached(r.json()) == 3 * BS + 2 * BS
    for stream in (False, True):
        body = {"prompt": ids(4 * BS + 3, seed=903 + stream), "n": 3, "max_tokens": 2, "temperature": 1.0,
                "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", warm.url + "/v1/completions", timeout=120, json=body) as r:
                usage = [json.loads(line[6:]) for line in r.iter_lines()
                         if line.startswith("data: {")][-1]["usage"]
        else:
            r = httpx.post(warm.url + "/v1/completions", timeout=120, json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage


def test_concurrent_requests_sharing_a_prefix(warm, reference):
    system = ids(4 * BS + 2, seed=4)
    prompts = [system + ids(3 + i, seed=40 + i) for i in range(8)]
    complete(warm, prompts[0])

    async def burst():
        async with httpx.AsyncClient(base_url=warm.url, timeout=120) as c:
            rs = await asyncio.gather(*[c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}) for p in prompts])
        return [r.json() for r in rs]

    bodies = asyncio.run(burst())
    # The 4 blocks of the shared prefix, and the prefix's last 2 tokens too for a request admitted once another
    # one's 5th block (those 2 tokens, its own, its output) is full and lends them: prompts[7] fills it after
    # 4 tokens, so a request the VM delays that long gets 66 (once in CI, 2026-11-27, which asked for 64).
    assert all(4 * BS <= cached(b) <= 4 * BS + 2 for b in bodies), [cached(b) for b in bodies]
    assert [text(b) for b in bodies] == [reference(p) for p in prompts]


# -- eviction respects the budget -------------------------------------------------------


def test_eviction_keeps_the_ram_tier_within_the_kv_budget(tiny_model, reference, tmp_path):
    budget = 2**20  # 2,048 tokens of the tiny model's KV (512 bytes/token): ~128 blocks at most
    srv = ServerProcess(tiny_model, "--kv-cache-memory", "1MiB", "--no-ssd-cache", *FLAGS, log_dir=tmp_path)
    try:
        prompts = [ids(5 * BS + 1, seed=100 + i) for i in range(36)]  # 180 distinct blocks
        seen = []
        for p in prompts[:28]:
            complete(srv, p, max_tokens=4)
            seen.append(srv.metric(RAM))
            assert seen[-1] <= budget
        # Concurrent requests: running sequences' KV squeezes the pool further.
        stop = False

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(*[c.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}) for p in prompts[28:]])

        async def scrape():
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
                while not stop:
                    for line in (await c.get("/metrics")).text.splitlines():
                        if line.startswith(RAM + " "):
                            seen.append(float(line.rsplit(" ", 1)[1]))
                    await asyncio.sleep(0.01)

        async def both():
            nonlocal stop
            task = asyncio.create_task(scrape())
            rs = await burst()
            stop = True
            await task
            return rs

        rs = asyncio.run(both())
        assert all(r.status_code == 200 for r in rs)
        assert max(seen) <= budget, max(seen)
        assert max(seen) >= budget // 2  # the pool did fill up
        assert srv.metric(EVICTIONS_RAM) > 0
        # LRU: the oldest prompt is gone, the newest is still there; answers are right either way.
        oldest, newest = complete(srv, prompts[0]), complete(srv, prompts[-1])
        assert cached(oldest) == 0 and cached(newest) == 5 * BS
        assert text(oldest) == reference(prompts[0]) and text(newest) == reference(prompts[-1])
        assert srv.metric(RAM) <= budget
    finally:
        srv.stop()


# -- the SSD tier across restarts, corrupted files, two models ---------------------------


RESTART_PROMPT = ids(6 * BS + 1, seed=5)
CORRUPT_BEFORE = {kind: ids(3 * BS + 4, seed=200 + i)
                  for i, kind in enumerate(("truncate", "garbage", "flip", "foreign"))}
CORRUPT_WHILE = {kind: ids(3 * BS + 4, seed=300 + i)
                 for i, kind in enumerate(("truncate", "garbage", "flip", "foreign"))}
# Things in a block file's place that the start-up checks passed (it was not there yet, or looked right).
HOSTILE_WHILE = {kind: ids(3 * BS + 4, seed=400 + i) for i, kind in enumerate(("fifo", "shape", "layers", "f16"))}


def foreign_file(model_b: Path, tmp: Path) -> Path:
    """A genuine block file of another model (its salt), written by the SSD tier itself."""
    salt = salt_of(model_b)
    tier = SSDTier(SSDConfig(tmp, 2**30, 7), salt, 0, KVShape(2, 2, 16, BS, mx.float32))
    key = block_keys(ids(BS, seed=9), salt)[0]
    arrays = [mx.random.normal((2, BS, 16), key=mx.random.key(i)) for i in range(4)]
    mx.eval(arrays)
    tier.save(key, Block(arrays[:2], arrays[2:]))
    tier.flush()
    return tier._path(key)


def corrupt(path: Path, kind: str, foreign: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "flip":  # the tensor data is at the end: the header still parses, the checksum must catch it
        buf = bytearray(data)
        for i in (1, 2, 100, 1000):
            buf[-i] ^= 0xFF
        path.write_bytes(bytes(buf))
    elif kind == "foreign":
        shutil.copyfile(foreign, path)
    else:
        raise ValueError(kind)


@pytest.fixture(scope="module")
def restarted(tiny_model, tiny_model_b, tmp_path_factory):
    """Seed an SSD cache with one server, damage some files while it is down, start a second server on it."""
    log_dir = tmp_path_factory.mktemp("restart")
    kv = log_dir / "kv"
    first = ServerProcess(tiny_model, *FLAGS, log_dir=log_dir)
    try:
        answers = {"restart": text(complete(first, RESTART_PROMPT))}
        seeded = [*CORRUPT_BEFORE.values(), *CORRUPT_WHILE.values(), *HOSTILE_WHILE.values()]
        for p in seeded:
            complete(first, p)
        expected_blocks = 6 + 3 * len(seeded)
        wait_for(lambda: first.metric(SSD) > 0 and len(list(kv.rglob("*" + SUFFIX))) >= expected_blocks,
                 what="SSD writes")
    finally:
        first.stop()
    foreign = foreign_file(tiny_model_b, tmp_path_factory.mktemp("foreign"))
    for kind, prompt in CORRUPT_BEFORE.items():
        corrupt(block_file(kv, tiny_model, prompt, 1), kind, foreign)
    # ...and another model's file copied in under its own name.
    rank_dir = block_file(kv, tiny_model, RESTART_PROMPT, 0).parent
    shutil.copyfile(foreign, rank_dir / foreign.name)
    # A plain safetensors file without metadata ("__metadata__": null), once fatal at start-up.
    mx.save_safetensors(str(rank_dir / ("ab" * 16 + SUFFIX)), {"k.0": mx.zeros((2, BS, 16))})
    second = ServerProcess(tiny_model, *FLAGS, log_dir=log_dir)
    second.dropped_at_start = second.metric(DROPPED)
    second.answers = answers
    second.kv = kv
    yield second
    second.stop()


def test_restart_serves_a_repeated_prompt_from_ssd(restarted, reference):
    ssd_hits = restarted.metric(HITS_SSD)
    body = complete(restarted, RESTART_PROMPT)
    assert cached(body) == 6 * BS
    assert restarted.metric(HITS_SSD) - ssd_hits >= 6
    assert text(body) == restarted.answers["restart"] == reference(RESTART_PROMPT)
    again = complete(restarted, RESTART_PROMPT)  # now promoted to RAM
    assert cached(again) == 6 * BS and text(again) == text(body)


def test_files_corrupted_while_down_are_dropped_and_answers_stay_right(restarted, reference):
    # truncate, garbage, foreign in place of ours, foreign under its own name, no metadata: dropped at
    # start-up. The flipped file has an intact header, so only its checksum catches it, when it is loaded.
    assert restarted.dropped_at_start == 5
    log = restarted.log.read_text()
    assert "5 dropped" in log
    dropped = restarted.metric(DROPPED)
    for kind, prompt in CORRUPT_BEFORE.items():
        body = complete(restarted, prompt)
        assert cached(body) == BS, kind  # block 0 is fine, block 1 is gone
        assert text(body) == reference(prompt), kind
    assert restarted.metric(DROPPED) - dropped == 1  # the flipped one
    assert "dropping KV block" in restarted.log.read_text() and "checksum mismatch" in restarted.log.read_text()


def test_files_corrupted_while_running_are_dropped_on_load(restarted, tiny_model, tiny_model_b, reference,
                                                           tmp_path):
    foreign = foreign_file(tiny_model_b, tmp_path)
    for kind, prompt in CORRUPT_WHILE.items():
        corrupt(block_file(restarted.kv, tiny_model, prompt, 1), kind, foreign)
    dropped = restarted.metric(DROPPED)
    for kind, prompt in CORRUPT_WHILE.items():
        body = complete(restarted, prompt)
        assert cached(body) == BS, kind
        assert text(body) == reference(prompt), kind
        assert block_file(restarted.kv, tiny_model, prompt, 0).exists()
    assert restarted.metric(DROPPED) - dropped == 4
    assert httpx.get(restarted.url + "/health").status_code == 200
    # Recomputed blocks are cached again.
    body = complete(restarted, CORRUPT_WHILE["garbage"])
    assert cached(body) == 3 * BS


def hostile(path: Path, kind: str) -> None:
    """Something in a block file's place: a FIFO, or a block of another layout or dtype whose key, rank,
    salt and checksum are right."""
    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
        return
    arrays, meta = mx.load(str(path), return_metadata=True)
    if kind == "shape":
        arrays["k.1"] = arrays["k.1"][:, : BS // 2]  # (2, 8, 16) where the store has (2, 16, 16)
    elif kind == "layers":
        arrays = {name: a for name, a in arrays.items() if name.endswith(".0")}
    elif kind == "f16":  # once cast to the float32 pool: answers changed, silently
        arrays = {name: a.astype(mx.float16) for name, a in arrays.items()}
    else:
        raise ValueError(kind)
    mx.eval(arrays)
    mx.save_safetensors(str(path), arrays, metadata={**meta, "checksum": checksum(arrays)})


def test_hostile_files_while_running_are_misses_not_hangs_or_failed_steps(restarted, tiny_model, reference):
    """Regression: a FIFO in a block's place hung the engine thread in open(): completions, /health and
    /v1/models timed out and SIGTERM did not stop the server. A block of another layout failed every step
    that loaded it: each request a 503, the engine exiting 70 after three, and again after each restart.
    A float16 block was cast into the float32 pool: other answers, silently."""
    for kind, prompt in HOSTILE_WHILE.items():
        hostile(block_file(restarted.kv, tiny_model, prompt, 1), kind)
    dropped = restarted.metric(DROPPED)
    for kind, prompt in HOSTILE_WHILE.items():
        body = complete(restarted, prompt, timeout=30)
        assert cached(body) == BS, kind  # the match ends at the bad file
        assert text(body) == reference(prompt), kind
        path = block_file(restarted.kv, tiny_model, prompt, 1)  # dropped; the recomputed block may be back
        assert not os.path.lexists(path) or stat.S_ISREG(os.lstat(path).st_mode), kind
    assert restarted.metric(DROPPED) - dropped == len(HOSTILE_WHILE)
    assert httpx.get(restarted.url + "/health", timeout=5).status_code == 200
    log = restarted.log.read_text()
    assert "not a regular file" in log and "a block of this store has" in log


def test_two_models_never_share_blocks(restarted, tiny_model, tiny_model_b, reference):
    """Model B on model A's cache directory: its own fingerprint directory, no hits on A's blocks."""
    kv = restarted.kv
    a_dir = block_file(kv, tiny_model, RESTART_PROMPT, 0).parent
    a_files = sorted(p.name for p in a_dir.iterdir())
    other = ServerProcess(tiny_model_b, *FLAGS, log_dir=kv.parent)
    try:
        first = complete(other, RESTART_PROMPT)
        assert cached(first) == 0
        assert other.metric(HITS_SSD) == 0 and other.metric(DROPPED) == 0
        again = complete(other, RESTART_PROMPT)
        assert cached(again) == 6 * BS and text(again) == text(first)
        assert text(first) != reference(RESTART_PROMPT)  # really another model
        wait_for(lambda: other.metric(SSD) > 0, what="model B's SSD writes")
    finally:
        other.stop()
    fingerprints = {p.name for p in kv.iterdir()}
    assert fingerprints == {model_fingerprint(tiny_model), model_fingerprint(tiny_model_b)}
    assert block_file(kv, tiny_model_b, RESTART_PROMPT, 0).is_file()
    assert sorted(p.name for p in a_dir.iterdir()) == a_files  # A's blocks untouched


def change_a_late_tensor(path: Path) -> str:
    """Roll (in place) the biggest tensor stored wholly past the first 64 KiB; header and sizes stay equal."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    spans = {name: [8 + n + o for o in v["data_offsets"]] for name, v in header.items() if name != "__metadata__"}
    late = {name: span for name, span in spans.items() if span[0] >= 65536}
    name = max(late, key=lambda k: late[k][1] - late[k][0])
    rolled = mx.roll(mx.load(str(path))[name], 1, axis=0)
    mx.eval(rolled)
    start, end = late[name]
    raw[start:end] = bytes(memoryview(rolled))
    path.write_bytes(bytes(raw))
    return name


@pytest.fixture(scope="module")
def tuned_model(tmp_path_factory) -> Path:
    """`tiny_model` made again (same seed), then a tensor stored past the first 64 KiB changed: a fine-tune
    that the old fingerprint (config.json + each file's first 64 KiB) could not tell from the base."""
    from meshlm.model.demo import make_tiny

    out = make_tiny(tmp_path_factory.mktemp("tuned") / "tiny-llama", "llama", layers=2, hidden=64, heads=4,
                    kv_heads=2)
    change_a_late_tensor(out / "model.safetensors")
    return out


def test_a_fine_tune_never_gets_the_base_models_kv_from_ssd(tiny_model, tuned_model, reference, tmp_path):
    assert (tiny_model / "config.json").read_bytes() == (tuned_model / "config.json").read_bytes()
    base_w, tuned_w = ((m / "model.safetensors").read_bytes() for m in (tiny_model, tuned_model))
    assert base_w[:65536] == tuned_w[:65536] and len(base_w) == len(tuned_w) and base_w != tuned_w
    assert model_fingerprint(tiny_model) != model_fingerprint(tuned_model)
    prompt = ids(6 * BS + 1, seed=8)
    kv = tmp_path / "kv"
    base = ServerProcess(tiny_model, *FLAGS, log_dir=tmp_path)
    try:
        assert text(complete(base, prompt)) == reference(prompt)
        wait_for(lambda: block_file(kv, tiny_model, prompt, 5).is_file(), what="the base model's SSD writes")
    finally:
        base.stop()
    tuned = ServerProcess(tuned_model, *FLAGS, log_dir=tmp_path)  # same --kv-cache-dir
    (tmp_path / "fresh").mkdir()
    fresh = ServerProcess(tuned_model, "--no-prefix-cache", *FLAGS, log_dir=tmp_path / "fresh")
    try:
        body = complete(tuned, prompt)
        assert cached(body) == 0 and tuned.metric(HITS_SSD) == 0
        assert text(body) == text(complete(fresh, prompt))
        assert text(body) != reference(prompt)  # the changed tensor matters, so a wrong hit would show
    finally:
        tuned.stop()
        fresh.stop()
    assert len(list(kv.iterdir())) == 2  # one fingerprint directory each


# -- two servers sharing one --kv-cache-dir ----------------------------------------------

SHARED_GB = "0.0002"  # 214,748 bytes: ~24 block files of ~8.7 KB
PROBLEMS = ("SSD KV cache off", "dropping KV block", "not kept on disk", "Traceback", "Exception in thread")


def burst(srv: ServerProcess, prompts: list[list[int]]) -> list[str]:
    """Concurrent greedy completions; every one must succeed."""
    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}) for p in prompts])

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [text(r.json()) for r in rs]


def tree_bytes(d: Path) -> int:
    """Bytes of every file under `d` (blocks and in-flight temp files); files vanishing meanwhile count 0."""
    total = 0
    for root, _, names in os.walk(d):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


class SharedLoad:
    """Writes to servers from threads (4 concurrent 5-block prompts a round), samples the directory size."""

    def __init__(self, rank_dir: Path) -> None:
        self.rank_dir = rank_dir
        self.answers: dict[tuple[int, ...], str] = {}
        self.sizes: list[int] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sizes.append(tree_bytes(self.rank_dir))
            time.sleep(0.01)

    def rounds(self, srv: ServerProcess, seed: int, n: int = 0, until: threading.Event | None = None) -> int:
        """`n` rounds, or rounds until `until` is set; returns how many ran."""
        done = 0
        while (until is not None and not until.is_set()) or done < n:
            prompts = [ids(5 * BS + 3, seed=seed + 10 * done + j) for j in range(4)]
            self.answers.update(zip(map(tuple, prompts), burst(srv, prompts)))
            done += 1
        return done

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join()


def test_two_servers_share_one_ssd_directory(tiny_model, reference, tmp_path):
    capacity = int(float(SHARED_GB) * 2**30)
    args = ("--ssd-cache-gb", SHARED_GB, *FLAGS)
    kv = tmp_path / "kv"
    rank_dir = block_file(kv, tiny_model, ids(BS, seed=0), 0).parent
    block = BS * 512 + 600  # KV bytes of a block (512 per token) and a generous header
    a, b = (ServerProcess(tiny_model, *args, log_dir=tmp_path) for _ in range(2))
    logs = [a.log, b.log]
    load = SharedLoad(rank_dir)
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(load.rounds, a, 1000, 4), pool.submit(load.rounds, b, 2000, 4)]:
                f.result()
            # Restart a while b keeps writing: a's start-up must leave b's files and temp files alone.
            restarted = threading.Event()
            writer = pool.submit(load.rounds, b, 3000, until=restarted)
            a.stop()
            a = ServerProcess(tiny_model, *args, log_dir=tmp_path)
            logs.append(a.log)
            restarted.set()
            assert writer.result() >= 2  # b wrote before, during and after a's start-up
            assert a.metric(DROPPED) == 0 and "0 dropped" in a.log.read_text()
            for f in [pool.submit(load.rounds, a, 4000, 3), pool.submit(load.rounds, b, 5000, 3)]:
                f.result()
        last = ids(5 * BS + 3, seed=6000)  # the newest blocks: no eviction may take them
        assert text(complete(b, last)) == reference(last)
        wait_for(lambda: all(block_file(kv, tiny_model, last, i).is_file() for i in range(5))
                 and not any((rank_dir / TMP_DIR).iterdir()), what="b's last SSD writes")
        assert a.metric(EVICTIONS_SSD) + b.metric(EVICTIONS_SSD) > 0
    finally:
        load.stop()
        a.stop()
        b.stop()
    for log in logs:
        assert not [p for p in PROBLEMS if p in log.read_text()], log
    assert len(load.answers) >= 2 * 4 * 4 + 2 * 4 + 2 * 3 * 4  # distinct prompts, ~5 blocks each
    assert all(answer == reference(list(p), 4) for p, answer in load.answers.items())
    # The stated slack (meshlm/cache/ssd.py): each writer may have written 5% of capacity the other has not
    # seen yet, plus one temp file in flight.
    slack = 2 * (capacity * RESCAN_FRACTION + block)
    assert max(load.sizes) > capacity * LOW_WATER  # the directory did fill up
    assert max(load.sizes) <= capacity + slack, (max(load.sizes), capacity)
    assert tree_bytes(rank_dir) <= capacity + slack
    third = ServerProcess(tiny_model, *args, log_dir=tmp_path)
    try:
        assert third.metric(DROPPED) == 0
        body = complete(third, last)
        assert cached(body) == 5 * BS and third.metric(HITS_SSD) >= 5
        assert text(body) == reference(last)
    finally:
        third.stop()


# -- a cache directory that cannot be used -----------------------------------------------


def check_ram_only_serving(srv: ServerProcess, reference, seed: int) -> None:
    prompt = ids(4 * BS + 3, seed=seed)
    first, second = complete(srv, prompt), complete(srv, prompt)
    assert cached(first) == 0 and cached(second) == 4 * BS
    assert text(first) == text(second) == reference(prompt)
    assert srv.metric(HITS_RAM) >= 4 and srv.metric(HITS_SSD) == 0
    assert httpx.get(srv.url + "/health").status_code == 200


def test_unwritable_cache_dir_degrades_to_ram_only(tiny_model, reference, tmp_path):
    # Tests run as root, which ignores permission bits: a path under a regular file can never be created.
    (tmp_path / "not-a-dir").write_text("a file")
    srv = ServerProcess(tiny_model, *FLAGS, "--kv-cache-dir", str(tmp_path / "not-a-dir" / "kv"),
                        log_dir=tmp_path)
    try:
        assert "SSD KV cache off" in srv.log.read_text()
        check_ram_only_serving(srv, reference, seed=6)
        assert srv.metric(SSD) == 0
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def full_disk(tiny_model, tmp_path_factory):
    """A server whose --kv-cache-dir is a 64 KiB tmpfs, filled by a few prompts."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tiny tmpfs needs root and mount(8)")
    log_dir = tmp_path_factory.mktemp("full")
    mnt = log_dir / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode().strip()}")
    srv = None
    try:
        srv = ServerProcess(tiny_model, *FLAGS, "--kv-cache-dir", str(mnt), log_dir=log_dir)
        for i in range(4):  # 20 blocks of ~8.6 KB: far beyond 64 KiB
            complete(srv, ids(5 * BS + 1, seed=400 + i))
        wait_for(lambda: "SSD KV cache off" in srv.log.read_text() or "Exception in thread" in srv.log.read_text(),
                 what="the SSD writer to hit the full disk")
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_cache_dir_keeps_serving_from_ram(full_disk, reference):
    check_ram_only_serving(full_disk, reference, seed=7)
    for i in range(4):
        prompt = ids(5 * BS + 1, seed=400 + i)
        body = complete(full_disk, prompt)
        assert cached(body) == 5 * BS and text(body) == reference(prompt)


def test_full_cache_dir_turns_ssd_off_with_a_warning(full_disk):
    """Regression: ENOSPC (then a RuntimeError from mx.save_safetensors, now an OSError from the block writer)
    used to kill the writer thread."""
    log = full_disk.log.read_text()
    assert log.count("SSD KV cache off") == 1
    assert "Exception in thread" not in log
    # Nothing is findable while the tier is off, and the bytes say so (they kept the total once written)
    assert full_disk.metric(SSD) == 0


def test_full_cache_dir_shuts_down_promptly(full_disk):
    t0 = time.monotonic()
    full_disk.stop()  # no writes stuck behind a dead writer thread
    assert full_disk.proc.returncode is not None and time.monotonic() - t0 < 4
