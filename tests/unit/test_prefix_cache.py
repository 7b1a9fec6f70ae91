"""The prefix cache: block keys, the RAM pool, the SSD tier and PrefixCache over a tiny model's real KV.

Everything here runs in-process on arrays; the server-level behaviour (greedy
output with the cache equals output without it, restarts, corrupted files)
is in tests/integration/test_prefix_cache_server.py.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

from meshlm.cache.keys import KEY_BYTES, CacheSalt, block_keys
from meshlm.cache.pool import Block, BlockPool
from meshlm.cache.prefix import PrefixCache
from meshlm.cache.ssd import FORMAT, SUFFIX, SSDConfig, SSDTier, checksum
from meshlm.config import SchedulerConfig
from meshlm.engine.request import SamplingParams, Sequence
from meshlm.engine.scheduler import Scheduler
from meshlm.model import demo
from meshlm.model.runner import Runner

BS = 4  # small blocks keep the arrays tiny
SALT = CacheSalt("f" * 24, "float32", "tp1", BS)
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


# -- the RAM pool ---------------------------------------------------------------


def test_pool_accounts_bytes_and_ignores_duplicates():
    b = fake_block()
    pool = BlockPool(10 * b.nbytes)
    pool.put(b"a", b)
    pool.put(b"a", fake_block(1))  # already there: kept once
    assert len(pool) == 1 and pool.nbytes == b.nbytes
    assert blocks_equal(pool.get(b"a"), b)
    assert pool.get(b"missing") is None


def test_pool_evicts_least_recently_used_within_budget():
    size = fake_block().nbytes
    pool = BlockPool(3 * size)
    for name in b"abc":
        pool.put(bytes([name]), fake_block(name))
    pool.get(b"a")  # a is now the most recent; b the least
    pool.put(b"d", fake_block(4))
    assert b"b" not in pool and all(k in pool for k in (b"a", b"c", b"d"))
    assert pool.nbytes == 3 * size and pool.evictions == 1
    pool.put(b"a", fake_block(0))  # re-putting refreshes too
    pool.put(b"e", fake_block(5))
    assert b"c" not in pool and b"a" in pool
    assert pool.nbytes <= pool.budget_bytes


def test_pool_trim_to_a_lower_limit_and_never_above_budget():
    size = fake_block().nbytes
    pool = BlockPool(4 * size)
    for i in range(4):
        pool.put(bytes([i]), fake_block(i))
    assert pool.trim(10**12) == 0 and len(pool) == 4  # a limit above the budget is the budget
    assert pool.trim(2 * size) == 2
    assert [k in pool for k in (b"\0", b"\1", b"\2", b"\3")] == [False, False, True, True]
    assert pool.trim(-5) == 2 and len(pool) == 0 and pool.nbytes == 0
    assert pool.evictions == 4


def test_pinned_blocks_are_never_evicted():
    size = fake_block().nbytes
    pool = BlockPool(2 * size)
    pool.put(b"old", fake_block(1))
    pool.pin(b"old")
    pool.pin(b"old")  # two users
    pool.put(b"x", fake_block(2))
    pool.put(b"y", fake_block(3))  # over budget: evicts x, not the older but pinned block
    assert b"old" in pool and b"x" not in pool and b"y" in pool
    assert pool.trim(0) == 1 and b"old" in pool and pool.nbytes == size
    pool.unpin(b"old")
    assert pool.trim(0) == 0 and b"old" in pool  # still one user
    pool.unpin(b"old")
    assert pool.trim(0) == 1 and len(pool) == 0 and pool.nbytes == 0


def test_pinned_blocks_may_overfill_but_the_rest_goes_first():
    size = fake_block().nbytes
    pool = BlockPool(2 * size)
    for i in range(2):
        pool.put(bytes([i]), fake_block(i))
        pool.pin(bytes([i]))
    pool.put(b"new", fake_block(9))  # nothing evictable but itself
    assert b"\0" in pool and b"\1" in pool and b"new" not in pool
    assert pool.nbytes == 2 * size


# -- the SSD tier ---------------------------------------------------------------


def make_tier(root: Path, salt: CacheSalt = SALT, capacity: int = 2**30, ttl_days: float = 7.0,
              rank: int = 0) -> SSDTier:
    return SSDTier(SSDConfig(root, capacity, ttl_days), salt, rank)


def write_blocks(root: Path, n: int, salt: CacheSalt = SALT, seed: int = 0) -> tuple[SSDTier, list[bytes]]:
    tier = make_tier(root, salt)
    keys = block_keys(ids(n * BS, seed=seed), salt)
    for i, k in enumerate(keys):
        tier.save(k, fake_block(seed * 100 + i))
    tier.flush()
    return tier, keys


def test_ssd_layout_and_round_trip(tmp_path):
    tier, keys = write_blocks(tmp_path, 3)
    assert tier.dir == tmp_path / SALT.model_fingerprint / SALT.directory / "rank_0"
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted(k.hex() + SUFFIX for k in keys)
    assert tier.writes == 3 and tier.nbytes == sum(p.stat().st_size for p in tier.dir.iterdir())
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
    assert sorted(p.name for p in mine.iterdir()) == sorted([keys[0].hex() + SUFFIX, "notes.txt"])
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


def test_ttl_expiry_drops_old_files(tmp_path):
    _, keys = write_blocks(tmp_path, 3)
    d = make_tier(tmp_path).dir
    now = time.time()
    os.utime(d / (keys[0].hex() + SUFFIX), (now - 3 * 86400, now - 3 * 86400))
    os.utime(d / (keys[1].hex() + SUFFIX), (now - 1.9 * 86400, now - 1.9 * 86400))
    tier = make_tier(tmp_path, ttl_days=2)
    assert keys[0] not in tier and not (d / (keys[0].hex() + SUFFIX)).exists()
    assert keys[1] in tier and keys[2] in tier


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
    assert tier.nbytes == sum(p.stat().st_size for p in tier.dir.iterdir())  # the running total stays true
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted(k.hex() + SUFFIX for k in more[2:])


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
    assert tier.dropped == 1 and tier.nbytes == tier._path(keys[1]).stat().st_size
    assert blocks_equal(tier.load(keys[1]), fake_block(1))


def test_unusable_directory_turns_the_tier_off_with_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="meshlm.cache.ssd"):
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
    tier.dir.rmdir()
    tier.dir.write_text("the directory is gone")  # every open() under it now fails
    with caplog.at_level(logging.WARNING, logger="meshlm.cache.ssd"):
        tier.save(b"\1" * 16, fake_block())
        tier.flush(timeout=1)
        tier.save(b"\2" * 16, fake_block(1))
        t0 = time.monotonic()
        tier.flush(timeout=1)
    assert not tier.enabled and "SSD KV cache off" in caplog.text
    assert time.monotonic() - t0 < 0.5


# -- PrefixCache over a tiny model's real KV ---------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = demo.make_tiny(tmp_path_factory.mktemp("tiny") / "tiny", model_type="llama", seed=0)
    model, _ = mlx_lm.load(str(path))
    return model


def prefill(model, tokens: list[int], cache: list[KVCache] | None = None):
    cache = cache if cache is not None else [KVCache() for _ in model.layers]
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits)
    return logits[0], cache


def kv_of(cache: list[KVCache]) -> list[tuple[mx.array, mx.array]]:
    return [(c.keys, c.values) for c in cache]


def test_store_match_restore_gives_back_the_stored_kv(model):
    pc = PrefixCache(SALT, BlockPool(2**30))
    tokens = ids(5 * BS + 3, seed=11)
    _, cache = prefill(model, tokens)
    assert pc.store(tokens, kv_of(cache)) == 5
    assert pc.store(tokens, kv_of(cache)) == 0  # nothing new
    assert pc.match(tokens) == 5 * BS and pc.stats.hits_ram == 5
    restored = pc.restore(tokens[: 5 * BS])
    assert len(restored) == len(model.layers)
    for (k, v), c in zip(restored, cache):
        assert k.shape == (1, c.keys.shape[1], 5 * BS, c.keys.shape[3])
        assert mx.array_equal(k, c.keys[:, :, : 5 * BS]).item()
        assert mx.array_equal(v, c.values[:, :, : 5 * BS]).item()
    assert not pc.pool._refs  # restore unpinned everything


def test_match_is_the_longest_whole_block_prefix(model):
    pc = PrefixCache(SALT, BlockPool(2**30))
    tokens = ids(4 * BS, seed=12)
    _, cache = prefill(model, tokens)
    pc.store(tokens, kv_of(cache))
    other = ids(3 * BS, seed=13)
    assert other[0] != tokens[2 * BS]
    cases = [
        (tokens, 4 * BS),
        (tokens[: 3 * BS + 2], 3 * BS + 2),  # ends inside a block: its first 2 tokens are lent
        (tokens[: 2 * BS] + other, 2 * BS),  # shares 2 blocks then diverges at once
        (tokens[: 2 * BS + 1] + other, 2 * BS + 1),  # diverges 1 token into the third block
        (tokens[: BS - 1], BS - 1),  # shorter than a block: lent whole
        (tokens + ids(3 * BS, seed=14), 4 * BS),  # longer than what is cached
    ]
    for query, want in cases:
        assert pc.match(query) == want, (len(query), want)
        pc.release(query[:want])
    assert not pc.pool._refs
    misses = pc.stats.misses
    assert pc.match(ids(3 * BS, seed=15)) == 0 and pc.stats.misses == misses + 1
    assert pc.match(ids(BS - 1, seed=15)) == 0 and pc.stats.misses == misses + 1  # too short to be a lookup


def test_a_match_ending_inside_a_block_restores_exactly_its_tokens(model):
    pc = PrefixCache(SALT, BlockPool(2**30))
    tokens = ids(3 * BS, seed=40)
    _, cache = prefill(model, tokens)
    pc.store(tokens, kv_of(cache))
    query = tokens[: BS + 3] + ids(2 * BS, seed=41)
    assert pc.match(query) == BS + 3
    assert pc.stats.hits_partial == 1 and pc.stats.partial_tokens == 3
    restored = pc.restore(query[: BS + 3])
    for (k, v), c in zip(restored, cache):
        assert mx.array_equal(k, c.keys[:, :, : BS + 3]).item()
        assert mx.array_equal(v, c.values[:, :, : BS + 3]).item()
    assert not pc.pool._refs and not pc._lent  # restore unpinned the lender too


def test_the_lender_is_the_block_sharing_the_most_tokens(model):
    pc = PrefixCache(SALT, BlockPool(2**30))
    head = ids(BS, seed=42)
    stored = {}
    for shared in (1, 3, 2):  # siblings under the same parent, sharing 1, 3, 2 leading tokens with the query
        seq = head + [7] * shared + [8 + shared] * (BS - shared) + ids(BS, seed=43)
        _, cache = prefill(model, seq)
        pc.store(seq, kv_of(cache))
        stored[shared] = cache
    query = head + [7] * BS
    assert pc.match(query) == BS + 3
    restored = pc.restore(query[: BS + 3])
    assert mx.array_equal(restored[0][0], stored[3][0].keys[:, :, : BS + 3]).item()


def test_partial_matches_release_their_pins_and_can_be_turned_off(model):
    tokens = ids(2 * BS, seed=44)
    _, cache = prefill(model, tokens)
    whole = PrefixCache(SALT, BlockPool(2**30), partial=False)
    whole.store(tokens, kv_of(cache))
    assert whole.match(tokens[: BS + 2] + [1]) == BS  # whole blocks only
    whole.release(tokens[:BS])
    pc = PrefixCache(SALT, BlockPool(2**30))
    pc.store(tokens, kv_of(cache))
    assert pc.match(tokens[: BS + 2] + [1]) == BS + 2
    pc.release(tokens[: BS + 2])
    assert not pc.pool._refs and not pc._lent and not whole.pool._refs


def test_a_rank_that_did_not_match_finds_a_lender_by_its_tokens(model):
    """Worker ranks restore what rank 0 matched; the same tokens under the same parent are enough."""
    tokens = ids(2 * BS, seed=45)
    _, cache = prefill(model, tokens)
    worker = PrefixCache(SALT, BlockPool(2**30))
    worker.store(tokens, kv_of(cache))
    restored = worker.restore(tokens[: BS + 2])
    assert mx.array_equal(restored[0][1], cache[0].values[:, :, : BS + 2]).item()
    with pytest.raises(KeyError, match="lending 3 tokens"):
        worker.restore(tokens[:BS] + [tokens[BS], tokens[BS + 1], tokens[BS + 2] + 1])


def test_evicted_blocks_stop_lending(model):
    tokens = ids(2 * BS, seed=46)
    _, cache = prefill(model, tokens)
    pc = PrefixCache(SALT, BlockPool(2**30))
    pc.store(tokens, kv_of(cache))
    pc.pool.trim(0)
    assert pc.match(tokens[:3]) == 0 and not pc._children and not pc._placed


def test_matched_blocks_survive_pressure_until_restored(model):
    tokens = ids(3 * BS, seed=16)
    _, cache = prefill(model, tokens)
    pc = PrefixCache(SALT, BlockPool(2**30))
    pc.store(tokens, kv_of(cache))
    block_bytes = pc.pool.nbytes // 3
    pc.pool.budget_bytes = 3 * block_bytes
    assert pc.match(tokens) == 3 * BS
    other = ids(3 * BS, seed=17)
    _, cache2 = prefill(model, other)
    pc.store(other, kv_of(cache2))  # pressure: only the new blocks can go
    pc.pool.trim(0)
    restored = pc.restore(tokens)
    assert mx.array_equal(restored[0][0], cache[0].keys[:, :, : 3 * BS]).item()
    pc.pool.trim(0)
    assert len(pc.pool) == 0
    assert pc.match(tokens) == 0
    with pytest.raises(KeyError):
        pc.restore(tokens)


@pytest.mark.parametrize("shared_len, first_tail, second_tail", [
    (3 * BS, BS + 1, 2 * BS + 3),  # same system prompt in whole blocks, new question
    (BS + 2, 2 * BS, BS + 3),  # a system prompt ending inside the second block: 2 tokens lent
], ids=["whole_blocks", "partial_block"])
def test_continuing_from_a_restored_prefix_equals_a_full_prefill(model, shared_len, first_tail, second_tail):
    pc = PrefixCache(SALT, BlockPool(2**30))
    shared = ids(shared_len, seed=18)
    first = shared + ids(first_tail, seed=19)
    _, cache = prefill(model, first)
    pc.store(first, kv_of(cache))
    second = shared + ids(second_tail, seed=20)
    n = pc.match(second[:-1])
    assert n == shared_len
    restored = [KVCache() for _ in model.layers]
    for c, (k, v) in zip(restored, pc.restore(second[:n])):
        c.state = (k, v, k.shape[2])
    warm, _ = prefill(model, second[n:], restored)
    cold, _ = prefill(model, second)
    assert mx.allclose(warm[-1], cold[-1], atol=1e-4).item()
    assert mx.argmax(warm[-1]).item() == mx.argmax(cold[-1]).item()


def test_blocks_come_back_from_ssd_in_a_new_process(model, tmp_path):
    tokens = ids(4 * BS + 1, seed=21)
    _, cache = prefill(model, tokens)
    first = PrefixCache(SALT, BlockPool(2**30), make_tier(tmp_path))
    first.store(tokens, kv_of(cache))
    first.ssd.flush()
    assert first.ssd.writes == 4
    # "Restart": a fresh RAM pool, a fresh tier indexing the same directory.
    second = PrefixCache(SALT, BlockPool(2**30), make_tier(tmp_path))
    assert second.match(tokens) == 4 * BS
    assert second.stats.hits_ssd == 4 and second.stats.hits_ram == 0 and len(second.pool) == 4
    for (k, v), c in zip(second.restore(tokens[: 4 * BS]), cache):
        assert mx.array_equal(k, c.keys[:, :, : 4 * BS]).item()
        assert mx.array_equal(v, c.values[:, :, : 4 * BS]).item()
    assert second.match(tokens) == 4 * BS and second.stats.hits_ram == 4  # promoted to RAM
    second.release(tokens[: 4 * BS])
    # Already on disk: not written again.
    assert second.store(tokens, kv_of(cache)) == 0


def test_a_bad_ssd_block_ends_the_match_there(model, tmp_path):
    tokens = ids(4 * BS, seed=22)
    _, cache = prefill(model, tokens)
    first = PrefixCache(SALT, BlockPool(2**30), make_tier(tmp_path))
    first.store(tokens, kv_of(cache))
    first.ssd.flush()
    keys = block_keys(tokens, SALT)
    path = first.ssd._path(keys[2])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    second = PrefixCache(SALT, BlockPool(2**30), make_tier(tmp_path))
    assert second.match(tokens) == 2 * BS
    assert second.ssd.dropped == 1 and not path.exists()
    second.release(tokens[: 2 * BS])


def test_another_salt_never_matches(model, tmp_path):
    tokens = ids(3 * BS, seed=23)
    _, cache = prefill(model, tokens)
    pool = BlockPool(2**30)
    PrefixCache(SALT, pool, make_tier(tmp_path)).store(tokens, kv_of(cache))
    other = CacheSalt("1" * 24, SALT.kv_dtype, SALT.layout, BS)
    assert PrefixCache(other, pool, make_tier(tmp_path, salt=other)).match(tokens) == 0


# -- scheduler + runner with the cache: same greedy tokens as without --------------


def drive(model, prompts: list[list[int]], arrival: list[int], cache: PrefixCache | None,
          step_tokens: int = 16, max_tokens: int = 6, kv_budget: int = 100_000,
          ) -> tuple[dict[int, list[int]], dict[int, int]]:
    sched = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=step_tokens), kv_budget,
                      min(kv_budget, 4096), prefix=cache)
    runner = Runner(model, cache)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens, temperature=0)) for i, p in enumerate(prompts)]
    t = 0
    while t <= max(arrival) or sched.has_work:
        for s in seqs:
            if arrival[s.uid] == t:
                sched.add(s)
        plan, _ = sched.schedule()
        result = runner.execute(plan)
        sampled = {}
        if result.logits is not None:
            sampled = dict(zip(result.uids, mx.argmax(result.logits, axis=-1).tolist()))
        sched.update(plan, sampled)
        t += 1
        assert t < 500
    if cache is not None:
        assert not cache.pool._refs  # every match was restored
    drive.preemptions = sched.num_preemptions
    return {s.uid: s.output_ids for s in seqs}, {s.uid: s.num_cached_tokens for s in seqs}


def test_runner_with_prefix_cache_matches_no_cache(model):
    system = ids(3 * BS + 2, seed=30)
    prompts = [
        system + ids(5, seed=31),
        system + ids(9, seed=32),  # arrives while the first decodes: shares 3 blocks
        ids(2 * BS, seed=33),
        ids(2 * BS, seed=33),  # the same prompt again, exactly 2 blocks
        system + ids(5, seed=31) + ids(BS * 2, seed=34),  # a follow-up turn
        system[: BS - 1] + ids(40, seed=35),  # long prompt, chunked, shares part of a block
    ]
    arrival = [0, 3, 4, 12, 20, 21]
    want, _ = drive(model, prompts, arrival, None)
    # A follow-up turn that includes the first turn's answer.
    prompts.append(prompts[0] + want[0] + ids(3, seed=36))
    arrival.append(30)
    want, _ = drive(model, prompts, arrival, None)
    got, cached = drive(model, prompts, arrival, PrefixCache(SALT, BlockPool(2**30)))
    assert got == want
    # The second prompt reuses all of the system prompt: 3 blocks, then 2 tokens lent by the first
    # prompt's fourth block.
    assert cached[0] == 0 and cached[1] == 3 * BS + 2 and cached[2] == 0
    assert cached[3] == 2 * BS - 1  # all but the last token, which is recomputed for its logits
    assert cached[4] >= 4 * BS
    assert cached[6] >= (len(prompts[0]) + len(want[0]) - 1) // BS * BS
    assert cached[5] == BS - 1


def test_preempted_sequences_resume_from_the_cache_with_the_same_tokens(model):
    """A tight KV budget forces preemption; the victim is re-admitted from its own cached blocks."""
    system = ids(2 * BS, seed=40)
    prompts = [system + ids(6 + i, seed=41 + i) for i in range(4)]
    arrival = [0, 0, 1, 2]
    want, _ = drive(model, prompts, arrival, None, max_tokens=20, kv_budget=100)
    preempted_without = drive.preemptions
    got, cached = drive(model, prompts, arrival, PrefixCache(SALT, BlockPool(2**30)), max_tokens=20,
                        kv_budget=100)
    assert preempted_without > 0 and drive.preemptions > 0
    assert got == want
    # The victim came back with more than the shared system prompt: its own prompt (and answer) blocks.
    assert max(cached.values()) > len(system)


def test_prompts_continuing_cached_prefixes_are_prefilled_together(model, monkeypatch):
    """Six prompts arriving together, sharing a system prompt by whole blocks, by part of a block, or
    not at all, with chunks of different lengths: one batched forward (rows that have a prefix recompute
    its tail instead of padding) gives the same tokens as no cache at all."""
    system = ids(2 * BS + 2, seed=60)
    prompts = [system + ids(3, seed=61)]
    prompts += [system + ids(1 + 2 * i, seed=62 + i) for i in range(4)]  # chunks of 1..7 tokens after the prefix
    prompts += [ids(6, seed=70), system[: BS + 1] + ids(9, seed=71)]  # fresh; a partial match only
    arrival = [0] + [12] * 6
    want, _ = drive(model, prompts, arrival, None, step_tokens=64)
    forwards = []
    original = Runner._prefill_batch

    def counting(self, chunks):
        forwards.append(sorted(c.uid for c in chunks))
        return original(self, chunks)

    monkeypatch.setattr(Runner, "_prefill_batch", counting)
    got, cached = drive(model, prompts, arrival, PrefixCache(SALT, BlockPool(2**30)), step_tokens=64)
    assert got == want
    assert all(cached[i] >= 2 * BS for i in range(1, 5)) and cached[5] == 0 and cached[6] == BS + 1
    assert forwards == [[1, 2, 3, 4, 5, 6]]


def test_prefill_groups_keep_each_rows_padding_small():
    from meshlm.engine.plan import Chunk
    from meshlm.model.runner import PREFILL_PAD_LIMIT, _prefill_groups

    def chunk(uid, n):
        return Chunk(uid, 0, tuple(range(n)), True)

    short = [chunk(i, 30) for i in range(15)]
    groups = _prefill_groups([chunk(99, 1000), *short])
    assert [len(g) for g in groups] == [1, 15]  # the long prompt does not pad fifteen short ones to 1,000
    mixed = [chunk(i, n) for i, n in enumerate((30, 90, 200, 95, 170))]
    assert PREFILL_PAD_LIMIT == 64  # the grouping below: 200 takes 170, 95 takes 90, 30 is 65 short of 95
    assert [sorted(c.uid for c in g) for g in _prefill_groups(mixed)] == [[2, 4], [1, 3], [0]]
