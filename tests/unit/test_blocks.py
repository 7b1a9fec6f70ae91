"""The block manager without arrays: allocation, sharing, copy-on-write, LRU, the exact budget, trims."""

from __future__ import annotations

import random

import pytest

from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.kv.blocks import BlockManager

BS = 4
SALT = CacheSalt("fp", "float32", "tp1", BS)


class Disk(set):
    """An SSD index: the keys it lists, all of them readable."""

    def prefetch(self, key: bytes) -> bool:
        return key in self

    def forget(self, key: bytes) -> None:
        self.discard(key)


def manager(num_blocks: int = 16, ssd=None, partial: bool = True, salt=SALT) -> BlockManager:
    return BlockManager(num_blocks, BS, salt, ssd, partial)


def run(bm: BlockManager, uid: int, tokens: list[int]) -> list[int]:
    """Admit `tokens` as a sequence that computes all of them (what the scheduler does)."""
    m = bm.match(uid, tokens[:-1])
    assert bm.allocate(uid, len(tokens)) is not None
    bm.commit(uid, lambda a, b: tokens[a:b], len(tokens))
    bm.end_step()
    return m


def test_fresh_ids_are_handed_out_lowest_first_and_counted_exactly():
    bm = manager(8, salt=None)
    assert bm.allocate(0, 5) == [0, 1] and bm.allocate(1, 9) == [2, 3, 4]
    assert bm.allocate(0, 8) == [] and bm.allocate(0, 9) == [5]
    assert (bm.num_used, bm.num_free, bm.high_water) == (6, 2, 6)
    assert bm.allocate(2, 12) is None and 2 in bm and bm.table(2) == []  # nothing changed
    bm.free(1)
    assert bm.allocate(2, 12) == [2, 3, 4]  # reused, lowest id first: the pool does not grow
    assert bm.high_water == 6


def test_a_prefix_hit_maps_the_same_blocks_without_copying():
    bm = manager()
    tokens = list(range(10, 22))  # three full blocks
    run(bm, 0, tokens)
    first = list(bm.table(0))
    m = bm.match(1, tokens + [99])
    assert m.tokens == 12 and m.copy is None and m.loads == []
    assert bm.table(1) == first  # the very same block ids: shared, ref-counted
    assert bm.stats.hits_ram == 3
    bm.free(0)
    assert bm.num_used == 3  # still held by sequence 1
    bm.free(1)
    assert bm.num_used == 0 and bm.num_cached == 3  # free, but findable (the RAM tier)


def test_a_match_ending_inside_a_block_copies_the_shared_tokens_into_a_fresh_block():
    bm = manager()
    run(bm, 0, list(range(10, 22)))
    lender = bm.table(0)[1]
    m = bm.match(1, [10, 11, 12, 13, 14, 15, 99, 98])  # block 0 whole, then 2 tokens of block 1
    assert m.tokens == 6 and m.copy == (lender, bm.table(1)[1], 2)
    assert bm.table(1)[0] == bm.table(0)[0] and bm.table(1)[1] != lender  # cached blocks are never written
    assert bm.stats.hits_partial == 1 and bm.stats.partial_tokens == 2


def test_the_lender_is_held_until_the_plan_is_built():
    bm = manager(5)
    run(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    bm.free(0)  # both blocks cached and free
    m = bm.match(1, [1, 2, 3, 4, 5, 9])
    lender = m.copy[0]
    assert bm.allocate(2, 8) is not None  # takes the two never-used ids...
    assert lender not in bm.table(2)
    assert bm.allocate(3, 4) is None  # ...and the lender cannot be evicted while the plan is being built
    bm.end_step()
    assert bm.allocate(3, 4) == [lender]


def test_partial_matches_can_be_turned_off():
    bm = manager(partial=False)
    run(bm, 0, list(range(10, 22)))
    m = bm.match(1, [10, 11, 12, 13, 14, 15, 99])
    assert m.tokens == 4 and m.copy is None


def test_free_cached_blocks_are_evicted_least_recently_used_first():
    bm = manager(4)
    run(bm, 0, [1, 2, 3, 4])
    run(bm, 1, [5, 6, 7, 8])
    run(bm, 2, [9, 10, 11, 12])
    for uid in (1, 0, 2):  # freed in this order: 1 is the least recently used
        bm.free(uid)
    run(bm, 3, [13, 14, 15, 16])  # takes the never-used id
    assert bm.match(4, [1, 2, 3, 4]).tokens == 4 and bm.match(5, [5, 6, 7, 8]).tokens == 4
    bm.free(4)
    bm.free(5)
    assert bm.allocate(6, 4) is not None and bm.stats.evictions == 1
    assert bm.match(7, [9, 10, 11, 12]).tokens == 0  # 2 was evicted: oldest among the free cached blocks


def test_the_budget_is_exact_whatever_the_mix_of_lengths():
    """One long and fifteen short sequences: the blocks held never exceed the budget."""
    bm = manager(48, salt=None)
    rng = random.Random(0)
    lengths = {0: 100}
    lengths.update({uid: rng.randint(1, 6) for uid in range(1, 16)})
    for uid, n in lengths.items():
        assert bm.allocate(uid, n) is not None
    assert bm.num_used == sum(-(-n // BS) for n in lengths.values()) <= 48
    assert bm.allocate(99, 4 * bm.num_free + 1) is None  # one block more than is left: refused


def test_commit_makes_full_final_blocks_findable_and_asks_for_ssd_saves():
    on_disk = Disk()
    bm = manager(ssd=on_disk)
    tokens = list(range(30, 41))  # two full blocks and three tokens
    bm.allocate(0, len(tokens))
    assert bm.commit(0, lambda a, b: tokens[a:b], 3) == []  # nothing full yet
    saves = bm.commit(0, lambda a, b: tokens[a:b], len(tokens))
    keys = block_keys(tokens, SALT)
    assert saves == list(zip(bm.table(0)[:2], keys)) and bm.stats.committed == 2
    on_disk.update(keys)
    bm.allocate(1, 8)
    assert bm.commit(1, lambda a, b: tokens[a:b], 8) == []  # the same content: already findable


def test_blocks_found_only_on_ssd_are_loaded_into_fresh_blocks():
    tokens = list(range(50, 62))
    keys = block_keys(tokens, SALT)
    bm = manager(ssd=Disk(keys[:2]))
    m = bm.match(0, tokens + [1])
    assert m.tokens == 8 and [k for k, _ in m.loads] == keys[:2]
    assert [b for _, b in m.loads] == bm.table(0) and bm.stats.hits_ssd == 2
    assert bm.match(1, tokens).tokens == 8 and bm.stats.hits_ram == 2  # findable at once, in RAM


def test_loaded_blocks_a_rank_could_not_read_are_never_found_again():
    tokens = list(range(50, 62))
    keys = block_keys(tokens, SALT)
    disk = Disk(keys[:2])
    bm = manager(ssd=disk)
    m = bm.match(0, tokens + [1])
    bm.match(1, tokens[:4] + [7])  # shares the first (loaded) block in RAM
    bm.end_step()
    bad = bm.forget_loaded(m.loads[1:])
    assert bad == {m.loads[1][1]} and disk == {keys[0]} and bm.stats.load_failures == 1
    assert bm.match(2, tokens + [1]).tokens == 4  # the first block, then nothing: neither RAM nor disk
    for uid in (0, 1, 2):
        bm.free(uid)
    assert bm.num_cached == 1  # the bad block went back as uncached, the good one stays findable
    # A bad block no sequence holds any more (it left before the check) leaves the LRU of cached blocks too.
    bm.forget_loaded(m.loads[:1])
    assert bm.num_cached == 0 and bm.num_free == 16 and bm.match(3, tokens + [1]).tokens == 0


def test_a_block_on_the_second_tier_is_not_prefetched_when_no_block_could_hold_it():
    """A received block's prefetch sets it aside for the load that follows (kv/received.py pins it): a match
    with no free block to load it into never loads it, and the pin stayed until an engine restart."""
    tokens = list(range(50, 62))
    asked = []

    class Counting(Disk):
        def prefetch(self, key: bytes) -> bool:
            asked.append(key)
            return super().prefetch(key)

    bm = manager(num_blocks=2, ssd=Counting(block_keys(tokens, SALT)), salt=SALT)
    assert bm.allocate(9, 8) is not None  # every block held by another sequence
    assert bm.match(0, tokens + [1]).tokens == 0 and asked == []
    bm.free(9)
    assert bm.match(1, tokens + [1]).tokens == 8 and len(asked) == 2


def test_trim_releases_the_blocks_past_the_kept_positions():
    bm = manager(salt=None)
    bm.allocate(0, 10)
    bm.trim(0, 5)
    assert len(bm.table(0)) == 2 and bm.num_used == 2
    bm.trim(0, 0)
    assert bm.table(0) == []


def test_committed_blocks_cannot_be_trimmed():
    bm = manager()
    tokens = list(range(8))
    bm.allocate(0, 9)
    bm.commit(0, lambda a, b: tokens[a:b], 8)
    with pytest.raises(ValueError):
        bm.trim(0, 6)


def test_without_a_salt_nothing_is_shared():
    bm = manager(salt=None)
    run(bm, 0, list(range(12)))
    assert bm.match(1, list(range(12))).tokens == 0 and bm.num_cached == 0


def test_a_ram_hit_refreshes_the_blocks_ssd_file_now_and_then_or_writes_it_again():
    """The SSD tier's LRU order and TTL go by its files' mtimes, which only loads refreshed: a prefix
    served from RAM all day was the first to expire or be evicted there (review helper-38)."""
    from meshlm.kv.blocks import REFRESH_SECONDS

    now = [1000.0]
    disk = Disk()
    bm = BlockManager(16, BS, SALT, disk, clock=lambda: now[0])
    prompt = list(range(3 * BS + 1))
    run(bm, 1, prompt)
    keys = block_keys(prompt[: 3 * BS], SALT)
    disk.update(keys)  # written through
    assert bm.take_refreshes() == ([], [])
    run(bm, 2, prompt)  # RAM hits: their files are touched
    assert bm.take_refreshes() == ([], keys)
    run(bm, 3, prompt)
    assert bm.take_refreshes() == ([], [])  # not again within REFRESH_SECONDS
    now[0] += REFRESH_SECONDS
    disk.discard(keys[1])  # evicted (or expired) on the SSD tier while hot here
    run(bm, 4, prompt)
    rewrites, touches = bm.take_refreshes()
    assert touches == [keys[0], keys[2]] and [k for _, k in rewrites] == [keys[1]]
    assert rewrites[0][0] == bm.table(4)[1]  # the block the sequence holds: its content is final
    assert manager(ssd=None).take_refreshes() == ([], [])


def test_a_sequence_shorter_than_its_computed_positions_never_keys_a_block_short():
    """A stop string found inside an accepted speculative run shortens the sequence after the next step
    was planned; that step's update then committed blocks keyed with 2 or 0 tokens (review helper-39)."""
    bm = manager(ssd=Disk())
    tokens = list(range(6))  # what the sequence holds now
    bm.match(1, tokens)
    assert bm.allocate(1, 12) is not None
    saves = bm.commit(1, lambda a, b: tokens[a:b], 12)  # KV was computed for 12 positions
    assert bm.num_cached == 1 and [k for _, k in saves] == block_keys(tokens[:BS], SALT)
