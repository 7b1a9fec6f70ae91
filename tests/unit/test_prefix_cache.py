"""The prefix cache: block keys, the SSD tier, and prefix hits (RAM, partial, SSD) over a tiny model's real KV.

Everything here runs in-process on arrays; the server-level behaviour (greedy
output with the cache equals output without it, restarts, corrupted files)
is in tests/integration/test_prefix_cache_server.py.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import os
import random
import stat
import struct
import time
import tracemalloc
from pathlib import Path

import mlx.core as mx
import pytest

from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig
from meshlm.engine.request import SamplingParams, Sequence
from meshlm.engine.scheduler import Scheduler
from meshlm.executor.rank import RankState, build_rank
from meshlm.kv.blocks import BlockManager
from meshlm.kv.keys import KEY_BYTES, CacheSalt, block_keys
from meshlm.kv.blockfile import checksum
from meshlm.kv.ssd import FORMAT, SUFFIX, TMP_DIR, SSDConfig, SSDTier
from meshlm.kv.store import BlockData as Block, KVShape
from meshlm.model import demo
from meshlm.model.loader import load_model

BS = 4  # small blocks keep the arrays tiny
SALT = CacheSalt("f" * 24, "float32", "tp1", BS)
SHAPE = KVShape(2, 2, 8, BS, mx.float32)  # the store `fake_block`'s blocks belong to
VOCAB = 400  # ids the tiny model knows


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def fake_block(seed: int = 0, layers: int = 2, heads: int = 2, dim: int = 8, bs: int = BS) -> Block:
    keys = mx.random.split(mx.random.key(seed), 2 * layers)
    ks = [mx.random.normal((heads, bs, dim), key=keys[i]) for i in range(layers)]
    vs = [mx.random.normal((heads, bs, dim), key=keys[layers + i]) for i in range(layers)]
    mx.eval(ks, vs)
    return Block(ks, vs)


def blocks_equal(a: Block, b: Block) -> bool:
    return (len(a.keys) == len(b.keys)
            and all(mx.array_equal(x, y).item() for x, y in zip(a.keys, b.keys))
            and all(mx.array_equal(x, y).item() for x, y in zip(a.values, b.values)))


# -- block keys ----------------------------------------------------------------


def test_keys_name_full_blocks_only():
    assert block_keys([], SALT) == []
    assert block_keys(ids(BS - 1), SALT) == []
    assert len(block_keys(ids(BS), SALT)) == 1
    assert len(block_keys(ids(3 * BS + BS - 1), SALT)) == 3  # a partial tail has no key
    assert all(len(k) == KEY_BYTES for k in block_keys(ids(5 * BS), SALT))


def test_same_prefix_same_keys_then_diverge():
    a = ids(5 * BS, seed=1)
    b = a[: 3 * BS] + ids(2 * BS, seed=2)
    ka, kb = block_keys(a, SALT), block_keys(b, SALT)
    assert ka[:3] == kb[:3]
    assert ka[3] != kb[3] and ka[4] != kb[4]
    # A tail appended to a prompt never changes the keys of its earlier blocks.
    assert block_keys(a + [7, 8, 9], SALT)[:5] == ka
    assert len(set(ka)) == len(ka)


def test_keys_chain_on_the_parent():
    """The same tokens in block 2 get a different key after a different block 1."""
    block2 = ids(BS, seed=3)
    k1 = block_keys(ids(BS, seed=4) + block2, SALT)
    k2 = block_keys(ids(BS, seed=5) + block2, SALT)
    assert k1[1] != k2[1]
    # ...and a block's key is not the key of its tokens alone.
    assert block_keys(block2, SALT)[0] not in (k1[1], k2[1])


@pytest.mark.parametrize("field, value", [
    ("model_fingerprint", "e" * 24), ("kv_dtype", "bfloat16"), ("layout", "tp2"), ("block_size", BS * 2),
])
def test_any_salt_field_changes_every_key(field, value):
    other = CacheSalt(**{**SALT.__dict__, field: value})
    tokens = ids(4 * BS * 2)
    mine, theirs = block_keys(tokens, SALT), block_keys(tokens, other)
    assert other.root() != SALT.root()
    assert not set(mine) & set(theirs)


def test_keys_are_deterministic_and_token_exact():
    t = ids(2 * BS)
    assert block_keys(t, SALT) == block_keys(list(t), CacheSalt(*SALT.__dict__.values()))
    t2 = list(t)
    t2[-1] += 1
    assert block_keys(t2, SALT)[0] == block_keys(t, SALT)[0]
    assert block_keys(t2, SALT)[1] != block_keys(t, SALT)[1]
    # Large ids (beyond 16/32 bits) hash distinctly too.
    assert block_keys([2**40] * BS, SALT) != block_keys([0] * BS, SALT)


# -- the SSD tier ---------------------------------------------------------------


def make_tier(root: Path, salt: CacheSalt = SALT, capacity: int = 2**30, ttl_days: float = 7.0,
              rank: int = 0) -> SSDTier:
    return SSDTier(SSDConfig(root, capacity, ttl_days), salt, rank, SHAPE)


def write_blocks(root: Path, n: int, salt: CacheSalt = SALT, seed: int = 0) -> tuple[SSDTier, list[bytes]]:
    tier = make_tier(root, salt)
    keys = block_keys(ids(n * BS, seed=seed), salt)
    for i, k in enumerate(keys):
        tier.save(k, fake_block(seed * 100 + i))
    tier.flush()
    return tier, keys


def blocks_on_disk(d: Path) -> dict[str, int]:
    """Block files directly in `d` (not temp files, not the lock) and their sizes."""
    return {p.name: p.stat().st_size for p in d.glob("*" + SUFFIX)}


def test_ssd_layout_and_round_trip(tmp_path):
    tier, keys = write_blocks(tmp_path, 3)
    assert tier.dir == tmp_path / SALT.model_fingerprint / SALT.directory / "rank_0"
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted([*(k.hex() + SUFFIX for k in keys), TMP_DIR])
    assert not any((tier.dir / TMP_DIR).iterdir())  # every temp file was renamed into place
    assert tier.writes == 3 and tier.nbytes == sum(blocks_on_disk(tier.dir).values())
    # A new process (a new tier) finds them all and loads exactly what was saved.
    again = make_tier(tmp_path)
    assert again.dropped == 0 and all(k in again for k in keys)
    for i, k in enumerate(keys):
        assert blocks_equal(again.load(k), fake_block(i))
    arrays, meta = mx.load(str(again.dir / (keys[0].hex() + SUFFIX)), return_metadata=True)
    assert meta["format"] == FORMAT and meta["key"] == keys[0].hex() and meta["salt"] == SALT.root().hex()
    assert meta["checksum"] == checksum(arrays)


def test_ssd_ranks_have_their_own_directories(tmp_path):
    make_tier(tmp_path, rank=0).save(b"\1" * 16, fake_block())
    r1 = make_tier(tmp_path, rank=1)
    assert r1.dir.name == "rank_1" and b"\1" * 16 not in r1


def test_save_skips_known_keys(tmp_path):
    tier, keys = write_blocks(tmp_path, 1)
    mtime = tier._path(keys[0]).stat().st_mtime_ns
    tier.save(keys[0], fake_block(5))
    tier.flush()
    assert tier.writes == 1 and tier._path(keys[0]).stat().st_mtime_ns == mtime


def test_checksum_covers_every_byte_and_name():
    b = fake_block()
    arrays = {f"k.{i}": a for i, a in enumerate(b.keys)} | {f"v.{i}": a for i, a in enumerate(b.values)}
    assert checksum(arrays) == checksum(dict(reversed(list(arrays.items()))))  # name order only
    flipped = dict(arrays)
    raw = arrays["v.1"]
    flipped["v.1"] = mx.where(mx.arange(raw.size).reshape(raw.shape) == 7, raw + 1e-3, raw)  # one element
    assert checksum(flipped) != checksum(arrays)
    renamed = {("x" + k if k == "k.0" else k): v for k, v in arrays.items()}
    assert checksum(renamed) != checksum(arrays)
    half = {k: v.astype(mx.float16) for k, v in arrays.items()}
    assert isinstance(checksum(half), str) and checksum(half) != checksum(arrays)


# Ways a block file goes bad. Each gets the path of a good file and damages it.
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _trailing_bytes(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0" * 10)


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _bad_json(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 5) + b"{not ")


def _wrong_format(path: Path) -> None:
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, metadata={**meta, "format": "other-kv-9"})


def _no_metadata(path: Path) -> None:
    arrays = mx.load(str(path))
    mx.save_safetensors(str(path), arrays)


def _other_key_in_metadata(path: Path) -> None:
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, metadata={**meta, "key": "00" * KEY_BYTES})


def _relaid(path: Path, change) -> None:
    """Rewrite a good block file with `change`d arrays, its metadata (key, rank, salt) kept and its checksum
    recomputed: a whole, consistent file only the store's shape tells from a good one."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = change(arrays)
    mx.eval(arrays)
    mx.save_safetensors(str(path), arrays, metadata={**meta, "checksum": checksum(arrays)})


OTHER_LAYOUTS = {  # blocks of a store other than the tier's
    "shorter_blocks": lambda a: {**a, "k.1": a["k.1"][:, : BS // 2]},
    "fewer_layers": lambda a: {n: x for n, x in a.items() if n.endswith(".0")},
    "float16": lambda a: {n: x.astype(mx.float16) for n, x in a.items()},  # once cast: other answers
}


STARTUP_DAMAGE = {
    "truncated": _truncate,
    "trailing_bytes": _trailing_bytes,
    "garbage": _garbage,
    "empty": _empty,
    "bad_json": _bad_json,
    "wrong_format": _wrong_format,
    "key_mismatch": _other_key_in_metadata,
}


@pytest.mark.parametrize("damage", sorted(STARTUP_DAMAGE))
def test_damaged_files_are_dropped_at_startup(tmp_path, damage):
    _, keys = write_blocks(tmp_path, 2)
    bad = make_tier(tmp_path).dir / (keys[1].hex() + SUFFIX)
    STARTUP_DAMAGE[damage](bad)
    tier = make_tier(tmp_path)
    assert tier.enabled and tier.dropped == 1
    assert not bad.exists() and keys[1] not in tier
    assert keys[0] in tier and blocks_equal(tier.load(keys[0]), fake_block(0))


@pytest.mark.parametrize("header", [b"123", b"[1, 2]", b'"text"', b"null",
                                    b'{"a": {"data_offsets": []}}', b'{"__metadata__": [1]}'],
                         ids=["int", "list", "str", "null", "short_offsets", "metadata_list"])
def test_structured_garbage_headers_are_dropped_not_fatal(tmp_path, header):
    """Regression: a header that parses but is not a dict of dicts used to crash SSDTier() (AttributeError)."""
    _, keys = write_blocks(tmp_path, 1)
    tier_dir = tmp_path / SALT.model_fingerprint / SALT.directory / "rank_0"
    (tier_dir / ("ab" * KEY_BYTES + SUFFIX)).write_bytes(struct.pack("<Q", len(header)) + header)
    tier = make_tier(tmp_path)
    assert tier.dropped == 1 and keys[0] in tier


def test_safetensors_file_without_metadata_is_dropped_not_fatal(tmp_path):
    """Regression: mx.save_safetensors writes "__metadata__": null without metadata; that crashed start-up."""
    _, keys = write_blocks(tmp_path, 2)
    _no_metadata(make_tier(tmp_path)._path(keys[1]))
    tier = make_tier(tmp_path)
    assert tier.dropped == 1 and keys[0] in tier and keys[1] not in tier


def test_foreign_and_stray_files_are_dropped_at_startup(tmp_path):
    other_salt = CacheSalt("0" * 24, "float32", "tp1", BS)  # another model's blocks
    other, other_keys = write_blocks(tmp_path, 2, salt=other_salt, seed=1)
    _, keys = write_blocks(tmp_path, 2)
    mine = make_tier(tmp_path).dir
    (other.dir / (other_keys[0].hex() + SUFFIX)).rename(mine / (other_keys[0].hex() + SUFFIX))  # copied in
    (other.dir / (other_keys[1].hex() + SUFFIX)).replace(mine / (keys[1].hex() + SUFFIX))  # posing as ours
    (mine / ("not-hex" + SUFFIX)).write_bytes(b"x" * 64)
    (mine / (keys[0].hex() + ".tmp" + SUFFIX)).write_bytes((mine / (keys[0].hex() + SUFFIX)).read_bytes())
    (mine / "notes.txt").write_text("not a block")
    tier = make_tier(tmp_path)
    assert tier.dropped == 4
    assert keys[0] in tier and keys[1] not in tier and other_keys[0] not in tier
    assert sorted(p.name for p in mine.iterdir()) == sorted([keys[0].hex() + SUFFIX, "notes.txt", TMP_DIR])
    # The other model's own directory is not touched.
    assert make_tier(tmp_path, salt=other_salt).dropped == 0


def test_flipped_tensor_bytes_pass_the_header_but_fail_the_checksum(tmp_path):
    _, keys = write_blocks(tmp_path, 2)
    path = make_tier(tmp_path)._path(keys[1])
    data = bytearray(path.read_bytes())
    for i in (len(data) - 1, len(data) - 77, len(data) - 500):  # tensor data sits at the end
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    tier = make_tier(tmp_path)
    assert tier.dropped == 0 and keys[1] in tier  # the header is intact
    assert tier.load(keys[1]) is None
    assert tier.dropped == 1 and keys[1] not in tier and not path.exists()
    assert blocks_equal(tier.load(keys[0]), fake_block(0))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "key_mismatch"])
def test_files_damaged_while_running_are_dropped_on_load(tmp_path, damage):
    tier, keys = write_blocks(tmp_path, 2)
    STARTUP_DAMAGE[damage](tier._path(keys[0]))
    assert keys[0] in tier
    assert tier.load(keys[0]) is None
    assert tier.dropped == 1 and keys[0] not in tier and not tier._path(keys[0]).exists()
    tier._path(keys[1]).unlink()  # vanished behind our back: a miss, not a crash
    assert tier.load(keys[1]) is None and keys[1] not in tier


@pytest.mark.timeout(20)  # the FIFO used to block the reading thread (the engine's) for good
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_fifo_or_a_device_in_place_of_a_block_is_a_miss_not_a_hang(tmp_path, kind, caplog):
    tier, keys = write_blocks(tmp_path, 2)
    path = tier._path(keys[0])
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")  # never to be read: it has no end
    with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
        assert tier.load(keys[0]) is None
    assert tier.dropped == 1 and keys[0] not in tier and not os.path.lexists(path)
    assert ("not a regular file" if kind == "fifo" else "symbolic link") in caplog.text
    assert blocks_equal(tier.load(keys[1]), fake_block(1))


def test_a_file_larger_than_any_block_is_dropped_unread(tmp_path, caplog):
    """Regression: a 3 GB sparse file in a block's place was read whole (RSS +3 GB) before it was refused."""
    tier, keys = write_blocks(tmp_path, 2)
    os.truncate(tier._path(keys[0]), 64 * 2**20)  # a good block's bytes, then (sparse) zeros
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
            assert tier.load(keys[0]) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20 and "a block file of this store has at most" in caplog.text
    assert tier.dropped == 1 and keys[0] not in tier and not tier._path(keys[0]).exists()
    assert blocks_equal(tier.load(keys[1]), fake_block(1))


@pytest.mark.parametrize("layout", sorted(OTHER_LAYOUTS))
def test_a_block_of_another_layout_is_dropped_on_load_and_at_startup(tmp_path, layout, caplog):
    tier, keys = write_blocks(tmp_path, 3)
    _relaid(tier._path(keys[0]), OTHER_LAYOUTS[layout])  # while the tier runs
    with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
        assert tier.load(keys[0]) is None
    assert tier.dropped == 1 and keys[0] not in tier and not tier._path(keys[0]).exists()
    assert "a block of this store has" in caplog.text
    _relaid(tier._path(keys[1]), OTHER_LAYOUTS[layout])  # while it is down
    again = make_tier(tmp_path)
    assert again.dropped == 1 and keys[1] not in again and not again._path(keys[1]).exists()
    assert blocks_equal(again.load(keys[2]), fake_block(2))


def test_ttl_expiry_drops_old_files(tmp_path):
    _, keys = write_blocks(tmp_path, 3)
    d = make_tier(tmp_path).dir
    now = time.time()
    os.utime(d / (keys[0].hex() + SUFFIX), (now - 3 * 86400, now - 3 * 86400))
    os.utime(d / (keys[1].hex() + SUFFIX), (now - 1.9 * 86400, now - 1.9 * 86400))
    tier = make_tier(tmp_path, ttl_days=2)
    assert keys[0] not in tier and not (d / (keys[0].hex() + SUFFIX)).exists()
    assert keys[1] in tier and keys[2] in tier
    # Expiry is an eviction (as a re-scan counts it), not a damaged file: that was a restart's 'N dropped'.
    assert tier.evictions == 1 and tier.dropped == 0


def test_a_restart_with_less_capacity_evicts_at_once(tmp_path):
    """It evicted only at its first write or lookup past the re-scan interval, which a worker rank (it never
    looks up) or a server of short prompts may not make for long: the directory and its gauge stayed over."""
    _, keys = write_blocks(tmp_path, 4)
    d = make_tier(tmp_path).dir
    now = time.time()
    for age, k in zip((40, 30, 20, 10), keys):
        os.utime(d / (k.hex() + SUFFIX), (now - age, now - age))
    size = (d / (keys[0].hex() + SUFFIX)).stat().st_size
    tier = make_tier(tmp_path, capacity=int(2.5 * size))
    assert [k in tier for k in keys] == [False, False, True, True]
    assert tier.evictions == 2 and tier.nbytes == sum(blocks_on_disk(d).values()) == 2 * size


def test_capacity_deletes_the_oldest_on_write(tmp_path):
    tier, keys = write_blocks(tmp_path, 1)
    size = tier.nbytes
    tier = make_tier(tmp_path, capacity=int(2.5 * size))
    more = block_keys(ids(4 * BS, seed=7), SALT)
    for i, k in enumerate(more):
        tier.save(k, fake_block(10 + i))
        tier.flush()
        assert tier.nbytes <= tier.config.capacity_bytes
    assert tier.evictions == 3
    assert [k in tier for k in [keys[0], *more]] == [False, False, False, True, True]
    assert tier.nbytes == sum(blocks_on_disk(tier.dir).values())  # the running total stays true
    assert sorted(blocks_on_disk(tier.dir)) == sorted(k.hex() + SUFFIX for k in more[2:])


def test_capacity_order_after_restart_follows_mtime(tmp_path):
    _, keys = write_blocks(tmp_path, 3)
    d = make_tier(tmp_path).dir
    now = time.time()
    for age, k in zip((10, 30, 20), keys):  # oldest: keys[1], then keys[2]
        os.utime(d / (k.hex() + SUFFIX), (now - age, now - age))
    size = (d / (keys[0].hex() + SUFFIX)).stat().st_size
    tier = make_tier(tmp_path, capacity=int(2.5 * size))
    new = block_keys(ids(BS, seed=9), SALT)[0]
    tier.save(new, fake_block(3))
    tier.flush()
    assert [k in tier for k in keys] == [True, False, False] and new in tier
    assert tier.nbytes <= tier.config.capacity_bytes


def test_a_hit_refreshes_the_file_so_a_restart_keeps_lru_order(tmp_path):
    _, keys = write_blocks(tmp_path, 3)
    d = make_tier(tmp_path).dir
    now = time.time()
    for age, k in zip((30, 20, 10), keys):  # keys[0] oldest
        os.utime(d / (k.hex() + SUFFIX), (now - age, now - age))
    tier = make_tier(tmp_path)
    assert blocks_equal(tier.load(keys[0]), fake_block(0))  # used now: newest, on disk too
    size = (d / (keys[0].hex() + SUFFIX)).stat().st_size
    tier = make_tier(tmp_path, capacity=int(3.5 * size))  # restart; the next write evicts one
    tier.save(block_keys(ids(BS, seed=9), SALT)[0], fake_block(3))
    tier.flush()
    assert [k in tier for k in keys] == [True, False, True]


def test_files_expire_while_running(tmp_path):
    """The TTL holds for a server that never restarts: an expired file is a miss at load time."""
    tier, keys = write_blocks(tmp_path, 2)
    old = time.time() - 8 * 86400  # TTL 7 days
    os.utime(tier._path(keys[0]), (old, old))
    assert tier.load(keys[0]) is None and keys[0] not in tier and not tier._path(keys[0]).exists()
    assert tier.evictions == 1 and tier.dropped == 0  # an eviction, not a damaged file (it was a WARNING)
    assert tier.nbytes == tier._path(keys[1]).stat().st_size
    assert blocks_equal(tier.load(keys[1]), fake_block(1))


def test_unusable_directory_turns_the_tier_off_with_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
        tier = make_tier(tmp_path / "file" / "kv")
    assert not tier.enabled
    assert "SSD KV cache off" in caplog.text
    tier.save(b"\1" * 16, fake_block())  # a no-op, not an error
    tier.flush(timeout=1)
    assert b"\1" * 16 not in tier and tier.nbytes == 0


def test_write_failure_turns_the_tier_off_with_a_warning(tmp_path, caplog):
    """Regression: mx.save_safetensors raises RuntimeError (not OSError) when it cannot write; that used to
    kill the writer thread silently, leaving the tier on and later saves stuck in its queue."""
    tier = make_tier(tmp_path)
    tier.save(b"\0" * 16, fake_block(2))
    tier.flush()
    assert tier.nbytes > 0
    for p in tier.dir.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    tier.dir.rmdir()
    tier.dir.write_text("the directory is gone")  # every open() under it now fails
    with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
        tier.save(b"\1" * 16, fake_block())
        tier.flush(timeout=1)
        tier.save(b"\2" * 16, fake_block(1))
        t0 = time.monotonic()
        tier.flush(timeout=1)
    assert not tier.enabled and "SSD KV cache off" in caplog.text
    assert time.monotonic() - t0 < 0.5
    assert tier.nbytes == 0  # /metrics: nothing findable any more (it kept showing the bytes once written)


# -- the prefix cache over a tiny model's real KV: hits give what a full prefill gives ----------


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo.make_tiny(tmp_path_factory.mktemp("tiny"), model_type="llama", seed=0)


def make_rank(path, tmp: Path | None = None, salt_fp: str | None = None, budget: int = 2**22) -> RankState:
    cfg = ModelConfig(str(path))
    loaded = load_model(cfg)
    if salt_fp is not None:
        loaded = dataclasses.replace(loaded, fingerprint=salt_fp)
    cache = CacheConfig(enabled=True, ssd=tmp is not None, cache_dir=str(tmp or "/nonexistent"), block_size=BS)
    return build_rank(loaded, cfg, cache, budget)


def run(rank: RankState, prompts: list[list[int]], n: int = 6, blocks: BlockManager | None = None,
        step_tokens: int = 64) -> tuple[dict[int, list[int]], dict[int, list[mx.array]], list, BlockManager]:
    """Greedy-decode `prompts` one after the other (each sees what the earlier ones cached)."""
    blocks = blocks or BlockManager(rank.max_blocks, rank.block_size, rank.salt, rank.ssd)
    sched = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=step_tokens), blocks, 1024)
    tokens, logits, plans = {}, {}, []
    for uid, prompt in enumerate(prompts):
        seq = Sequence(uid, prompt, SamplingParams(max_tokens=n, temperature=0))
        sched.add(seq)
        while sched.has_work:
            plan, _ = sched.schedule()
            plans.append(plan)
            result = rank.step(plan)
            # As the engine's _check_loads: sequences that read a block the rank could not load are recomputed.
            gone = set(sched.recompute_unloaded(plan, frozenset(result.missing))) if result.missing else set()
            sampled = {}
            if result.logits is not None:
                sampled = {u: [t] for u, t in zip(result.uids, mx.argmax(result.logits, axis=-1).tolist())
                           if u not in gone}
                for i, u in enumerate(result.uids):
                    if u not in gone:
                        logits.setdefault(u, []).append(result.logits[i])
            sched.update(plan, sampled)
        tokens[uid] = seq.output_ids
    rank.flush()
    return tokens, logits, plans, blocks


def same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(mx.abs(x - y).max().item() < 1e-4 for x, y in zip(a, b))


SHARED = ids(3 * BS + 2, seed=1)
PROMPTS = [SHARED + ids(5, seed=2), SHARED + ids(7, seed=3), SHARED[: 2 * BS + 1] + ids(4, seed=4), SHARED[:BS]]


def test_hits_give_the_tokens_and_logits_of_a_full_prefill(path):
    """Whole blocks shared in RAM, a match ending inside a block (copy), a prompt that is all prefix."""
    cold = [run(make_rank(path), [p]) for p in PROMPTS]  # each alone: nothing to hit
    tokens, logits, plans, blocks = run(make_rank(path), PROMPTS)
    for uid, (t, lg, _, _) in enumerate(cold):
        assert tokens[uid] == t[0] and same(logits[uid], lg[0]), uid
    cached = {n.uid: n.cached_len for p in plans for n in p.new}
    assert cached == {0: 0, 1: 3 * BS + 2, 2: 2 * BS + 1, 3: BS - 1}
    assert blocks.stats.hits_ram >= 5 and blocks.stats.hits_partial >= 2
    assert sum(len(p.copies) for p in plans) == blocks.stats.hits_partial


def test_blocks_come_back_from_ssd_in_a_new_process(path, tmp_path):
    first = run(make_rank(path, tmp_path), PROMPTS[:1])
    tokens, logits, plans, blocks = run(make_rank(path, tmp_path), PROMPTS[:1])  # a restart: RAM is empty
    assert tokens == first[0] and same(logits[0], first[1][0])
    whole = (len(PROMPTS[0]) - 1) // BS  # the last prompt token is always computed
    assert blocks.stats.hits_ssd == whole and sum(len(p.loads) for p in plans) == whole


def test_a_bad_ssd_block_ends_the_match_there(path, tmp_path):
    run(make_rank(path, tmp_path), PROMPTS[:1])
    rank = make_rank(path, tmp_path)
    files = {p.name: p for p in rank.ssd.dir.glob("*" + SUFFIX)}
    second_key = block_keys(PROMPTS[0], rank.salt)[1]
    raw = bytearray(files[second_key.hex() + SUFFIX].read_bytes())
    raw[-5] ^= 0xFF  # a flipped tensor byte: the checksum catches it when the block is read
    files[second_key.hex() + SUFFIX].write_bytes(bytes(raw))
    tokens, logits, plans, blocks = run(rank, PROMPTS[:1])
    assert [n.cached_len for p in plans for n in p.new] == [BS]  # the first block only: never a bad one
    cold = run(make_rank(path), PROMPTS[:1])
    assert tokens == cold[0] and same(logits[0], cold[1][0])


def test_a_planned_block_a_rank_cannot_read_is_recomputed_with_the_same_tokens(path, tmp_path):
    """Every rank reads a plan's loads from its own SSD tier, which evicts, expires and fails on its own:
    a block the leader listed and verified may be gone on another rank. That rank used to fail the step
    (BlockMissing), and a cluster then failed every request and restarted into the same loop. Now its
    result names the block; the sequences that read it are recomputed, and the block is never listed again."""
    first = run(make_rank(path, tmp_path), PROMPTS[:1])
    rank = make_rank(path, tmp_path)
    second = block_keys(PROMPTS[0], rank.salt)[1]
    listed, read = rank.ssd.load, []
    rank.ssd.load = lambda key: read.append(key) or (None if key == second else listed(key))  # "another rank's copy"
    tokens, logits, plans, blocks = run(rank, PROMPTS[:1])
    assert second in read and blocks.stats.load_failures == 1
    whole = (len(PROMPTS[0]) - 1) // BS
    # Planned from SSD, then recomputed: the first block from RAM (it loaded), the rest computed again.
    assert [n.cached_len for p in plans for n in p.new] == [whole * BS, BS]
    assert tokens == first[0] and same(logits[0], first[1][0])
    again = run(make_rank(path, tmp_path), PROMPTS[:1])  # forgotten (deleted), then saved anew by the recompute
    assert again[3].stats.hits_ssd == whole and again[0] == first[0]


def test_a_planned_block_this_rank_reads_but_cannot_hold_is_dropped_from_its_disk(path, tmp_path):
    """The runner's own check of a loaded block (layers and shape against its store) found a problem:
    it called a method the SSD tier does not have (AttributeError, a failed step). Now the block is a
    miss like a missing one, and its file is deleted, or every later plan loading it would fail again."""
    first = run(make_rank(path, tmp_path), PROMPTS[:1])
    rank = make_rank(path, tmp_path)
    second = block_keys(PROMPTS[0], rank.salt)[1]
    listed = rank.ssd.load
    rank.ssd.load = lambda key: (lambda d: Block(d.keys[:1], d.values[:1]) if key == second else d)(listed(key))
    forgotten, forget = [], rank.ssd.forget
    rank.ssd.forget = lambda key: forgotten.append(key) or forget(key)
    tokens, logits, plans, blocks = run(rank, PROMPTS[:1])
    assert blocks.stats.load_failures == 1 and tokens == first[0] and same(logits[0], first[1][0])
    assert forgotten == [second, second]  # by the runner (this rank's file), then by the leader's listing


@pytest.mark.parametrize("layout", sorted(OTHER_LAYOUTS))
def test_a_block_of_another_layout_ends_the_match_and_never_fails_a_step(path, tmp_path, layout):
    """Regression: such a file passed the tier's checks and failed every step that loaded it (BlockMissing)."""
    run(make_rank(path, tmp_path), PROMPTS[:1])
    rank = make_rank(path, tmp_path)
    _relaid(rank.ssd._path(block_keys(PROMPTS[0], rank.salt)[1]), OTHER_LAYOUTS[layout])
    tokens, logits, plans, blocks = run(rank, PROMPTS[:1])
    assert [n.cached_len for p in plans for n in p.new] == [BS]  # the first block only
    assert rank.ssd.dropped == 1
    cold = run(make_rank(path), PROMPTS[:1])
    assert tokens == cold[0] and same(logits[0], cold[1][0])


def test_another_model_never_matches(path, tmp_path):
    run(make_rank(path, tmp_path), PROMPTS[:1])
    other = make_rank(path, tmp_path, salt_fp="another-model-fingerprint")
    _, _, plans, blocks = run(other, PROMPTS[:1])
    assert [n.cached_len for p in plans for n in p.new] == [0] and blocks.stats.hits_ssd == 0


def test_preempted_sequences_resume_from_the_cache_with_the_same_tokens(path):
    rank = make_rank(path, budget=12 * make_rank(path).store.shape.block_bytes)  # 48 positions
    blocks = BlockManager(rank.max_blocks, rank.block_size, rank.salt, None)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_tokens_per_step=32), blocks, 1024)
    seqs = [Sequence(i, ids(14, seed=10 + i), SamplingParams(max_tokens=20, temperature=0)) for i in range(2)]
    for s in seqs:
        sched.add(s)
    resumed = []
    while sched.has_work:
        plan, _ = sched.schedule()
        resumed += [n.cached_len for n in plan.new if any(s.uid == n.uid and s.num_preemptions for s in seqs)]
        result = rank.step(plan)
        sampled = {u: [t] for u, t in zip(result.uids, mx.argmax(result.logits, axis=-1).tolist())} if result.uids else {}
        sched.update(plan, sampled)
    assert sched.num_preemptions >= 1 and max(resumed) > 0  # the recompute started from cached blocks
    for s in seqs:
        assert s.output_ids == run(make_rank(path), [s.prompt_ids], 20)[0][0], s.uid


def test_a_directory_in_one_blocks_place_keeps_that_block_off_disk_not_the_whole_tier(tmp_path):
    """os.replace onto a directory raised IsADirectoryError, which turned the tier off for every block."""
    tier = make_tier(tmp_path)
    keys = block_keys(ids(3 * BS, seed=5), SALT)
    tier._path(keys[0]).mkdir(parents=True)
    for i, k in enumerate(keys):
        tier.save(k, fake_block(i))
    tier.flush()
    assert tier.enabled and keys[0] not in tier and all(k in tier for k in keys[1:])
    assert list((tier.dir / TMP_DIR).iterdir()) == []  # its temp file went too


def test_a_tier_too_small_for_one_block_is_off_saying_so(tmp_path, caplog):
    """It wrote every block and evicted it at once: disk writes for nothing, and no word why nothing hit."""
    tier = make_tier(tmp_path, capacity=SHAPE.block_bytes - 1)
    assert not tier.enabled and "holds no KV block of this store" in caplog.text
    # Nor one that holds a block's tensors but not its file (the header, padded to 4 KiB, comes on top):
    assert not make_tier(tmp_path, capacity=SHAPE.block_bytes + 100).enabled
    tier.save(block_keys(ids(BS), SALT)[0], fake_block(0))
    tier.flush()
    assert not list(tmp_path.rglob("*" + SUFFIX)) and tier.writes == 0


def test_a_touch_makes_a_block_the_most_recently_used_on_disk_and_in_the_index(tmp_path):
    tier, keys = write_blocks(tmp_path, 3)
    old = time.time() - 3600
    for k in keys:
        os.utime(tier._path(k), (old, old))
    tier.touch(keys[0])
    tier.touch(b"\7" * KEY_BYTES)  # not listed: nothing to refresh
    tier.flush()
    assert tier._path(keys[0]).stat().st_mtime > old + 3000 and tier._path(keys[1]).stat().st_mtime < old + 1
    assert list(tier._index)[-1] == keys[0]
    # and a re-scan (another process's view, a restart) orders it last too
    tier._enforce_capacity()
    assert list(tier._index)[-1] == keys[0]


def test_a_plan_refreshes_the_ssd_files_of_blocks_hit_in_ram(path, tmp_path):
    """End to end through the scheduler's plans and the runner: a prefix hit from RAM again and again
    kept its file's first mtime, so it expired and was evicted first on the SSD tier (review helper-38)."""
    rank = make_rank(path, tmp_path)
    hot = ids(3 * BS + 2, seed=1)
    _, _, _, blocks = run(rank, [hot], n=1)
    tier = rank.ssd
    keys = block_keys(hot[: 3 * BS], rank.salt)
    assert all(k in tier for k in keys)
    old = time.time() - 3600
    for k in keys:  # an hour old, as if written long ago
        os.utime(tier._path(k), (old, old))
    _, _, plans, _ = run(rank, [hot], n=1, blocks=blocks)  # hit in RAM: the plan asks the rank to touch them
    assert [k for p in plans for k in p.touches] == keys and not any(p.saves for p in plans)
    assert all(tier._path(k).stat().st_mtime > old + 3000 for k in keys)


def test_a_tier_expires_the_abandoned_files_of_other_models_and_layouts(tmp_path):
    """TTL and capacity were kept per model/layout/rank directory: a model upgrade, another dtype or block
    size left its files under --kv-cache-dir for good (review helper-38). The TTL now covers them all."""
    other = dataclasses.replace(SALT, model_fingerprint="an-older-model")
    old_tier, keys = write_blocks(tmp_path, 3, salt=other)
    old = time.time() - 8 * 86400  # past the 7-day TTL
    for k in keys[:2]:
        os.utime(old_tier._path(k), (old, old))
    (old_tier.dir / "notes.txt").write_text("not a block")  # not ours: left alone
    make_tier(tmp_path)  # a server of this model starts
    assert sorted(blocks_on_disk(old_tier.dir)) == [keys[2].hex() + SUFFIX]
    assert (old_tier.dir / "notes.txt").exists() and old_tier.dir.is_dir()


def test_a_tier_that_turns_itself_off_lets_go_of_its_prefetched_blocks(tmp_path):
    """A tier turned off (a full disk) kept up to 1 GiB of prefetched blocks until restart (review
    helper-38); a plan already loading one still reads it from the file."""
    tier, keys = write_blocks(tmp_path, 2)
    assert tier.prefetch(keys[0]) and tier._staged
    tier._disable("test: the disk is full")
    assert not tier._staged and not tier.enabled
    assert blocks_equal(tier.load(keys[0]), fake_block(0))


def test_the_tiers_files_and_directories_are_the_serving_users_alone(tmp_path):
    """Blocks were written 0644 in 0755 directories: another local user could read them, and a prompt's
    text can be read back from its KV (review helper-44). Directories are now 0700 (ours tightened), files
    0600, the lock and writes follow no planted link."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    tier, keys = write_blocks(root, 2)
    tier._enforce_capacity()  # takes the lock
    level = root
    for part in (None, *tier.dir.relative_to(root).parts, "tmp"):
        level = level if part is None else level / part
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700, level
    for f in tier.dir.iterdir():
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_tier_refuses_a_directory_tree_it_does_not_own_or_a_planted_link(tmp_path):
    """A tree another user made (or may write) is one they can plant blocks in, changing answers; a link in
    a level's place takes the writes elsewhere (review helper-44). The tier turns off instead."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "kv"
    root.mkdir()
    (root / SALT.model_fingerprint).symlink_to(elsewhere)
    tier = make_tier(root)
    assert not tier.enabled and not any(elsewhere.iterdir())
    if os.getuid() == 0:  # chown to another user needs root (the CI's user here)
        other = tmp_path / "other"
        other.mkdir()
        os.chown(other, 65534, 65534)
        assert not make_tier(other).enabled
