"""The leader's blocks with --cp-min-tokens: sequences shorter than T kept whole on one rank (placed by
load, b positions per id on that rank), longer ones split as before, over one exact budget."""

from __future__ import annotations

import pytest

from meshlm.kv.blocks import BlockManager
from meshlm.kv.context_blocks import ContextBlocks
from meshlm.kv.keys import CacheSalt

B = 4  # positions per rank's block; a split block id covers 2 * B


def blocks(num: int = 8, min_tokens: int = 100, ranks: int = 2) -> ContextBlocks:
    inner = BlockManager(num, ranks * B, CacheSalt("fp", "float32", "cp2", B))
    return ContextBlocks(inner, ranks, B, min_tokens)


def admit(cb: ContextBlocks, uid: int, length: int) -> list[int]:
    assert cb.can_admit(length)
    cb.match(uid, list(range(length - 1)), length)
    assert cb.allocate(uid, length) is not None
    cb.end_step()
    return cb.table(uid)


def test_short_sequences_go_whole_to_the_least_loaded_rank_and_long_ones_split():
    cb = blocks(num=16, min_tokens=20)
    admit(cb, 1, 10)  # whole on rank 0: ceil(10 / B) = 3 blocks
    admit(cb, 2, 5)  # rank 1 holds fewer blocks: 2 there
    admit(cb, 3, 3)  # rank 1 again (2 < 3 blocks)
    admit(cb, 4, 40)  # split: ceil(40 / 2B) = 5 ids
    assert [cb.holder(u) for u in (1, 2, 3, 4)] == [0, 1, 1, -1]
    assert cb.whole_stats.placed == [1, 2] and cb.whole_blocks() == [3, 3]
    assert cb.num_free == 16 - 3 - 5  # rank 1's whole blocks use the slots of rank 0's ids


def test_a_placement_the_scheduler_backs_out_of_is_not_counted():
    """A sequence placed but then not admitted (no block left, or no work left in the step) is freed holding
    nothing: it was counted on every step it waited."""
    cb = blocks(num=16, min_tokens=20)
    for _ in range(3):
        cb.match(1, list(range(9)), 10)
        cb.free(1)
    assert cb.whole_stats.placed == [0, 0]
    admit(cb, 1, 10)
    cb.free(1)  # a sequence that ran stays counted
    assert cb.whole_stats.placed == [1, 0]


def test_ranks_share_the_ids_they_lend_and_give_them_back_when_both_are_done():
    cb = blocks()
    t1 = admit(cb, 1, 10)  # rank 0: 3 ids taken from the block manager
    t2 = admit(cb, 2, 9)  # rank 1: the same 3 ids' other slots
    assert sorted(t1) == sorted(t2) and cb.num_free == 8 - 3
    cb.free(1)
    assert cb.num_free == 8 - 3  # rank 1 still uses them
    cb.free(2)
    assert cb.num_free == 8 and cb.whole_blocks() == [0, 0]


def test_whole_and_split_sequences_share_one_exact_budget():
    cb = blocks(num=4, min_tokens=20)
    admit(cb, 1, 24)  # split: 3 ids of 2B positions
    assert cb.holder(1) == -1 and len(cb.table(1)) == 3 and cb.num_free == 1
    admit(cb, 2, 3)  # whole on rank 0: the last id
    assert cb.num_free == 0 and cb.can_admit(3)  # rank 1 may still use that id's other slot
    assert not cb.can_admit(7)  # 2 blocks on one rank: no
    assert cb.allocate(2, 8) is None  # rank 0 has nothing left
    cb.free(1)
    assert len(cb.allocate(2, 8)) == 1 and cb.num_free == 2


def test_growth_trim_and_cover_count_b_positions_per_id_on_the_holder():
    cb = blocks(num=6)
    admit(cb, 1, 6)  # rank 0, 2 blocks
    assert cb.cover(1) == (2 + 6 - 2) * B
    assert len(cb.allocate(1, 17)) == 3 and len(cb.table(1)) == 5
    cb.trim(1, 9)
    assert len(cb.table(1)) == 3 and cb.whole_blocks() == [3, 0] and cb.num_free == 3
    assert cb.commit(1, lambda a, b: list(range(a, b)), 9) == []  # never cached


def test_a_uid_is_placed_once():
    cb = blocks()
    admit(cb, 1, 5)
    with pytest.raises(ValueError):
        cb.match(1, [1, 2, 3], 4)


def test_a_short_prompt_that_may_outgrow_one_ranks_pools_is_split():
    cb = blocks(num=8, min_tokens=100)  # one rank's pools: 8 * B = 32 positions
    assert cb.can_admit(10, reach=32)
    cb.match(1, list(range(9)), 10, reach=32)
    cb.match(2, list(range(9)), 10, reach=33)
    assert (cb.holder(1), cb.holder(2)) == (0, -1)


def test_a_whole_sequence_that_generates_nothing_needs_no_next_position():
    """Echo with max_tokens 0 (reach = its length): one rank's whole pools hold it exactly; asking for the
    next token's position too, it waited for ever (and so did the queue behind it)."""
    cb = blocks(num=8, min_tokens=100)  # one rank's pools: 8 * B = 32 positions
    assert cb.can_admit(32, reach=32)
    cb.match(1, list(range(31)), 32, reach=32)
    assert cb.allocate(1, 32) is not None and cb.holder(1) == 0


def test_blocks_a_rank_could_not_load_are_forgotten_through_it():
    """Scheduler.recompute_unloaded has the block manager forget loaded blocks some rank could not read.
    ContextBlocks had no forget_loaded: under --cp-min-tokens such a step failed every request in flight
    with an AttributeError instead of recomputing the sequences that held them."""
    from meshlm.kv.keys import chain_key

    cb = blocks(num=8, min_tokens=4)
    tokens = list(range(20))
    admit(cb, 1, 20)  # split: the prefix cache's
    cb.commit(1, lambda a, b: tokens[a:b], 20)
    first = chain_key(cb.inner.salt.root(), tuple(tokens[:2 * B]))
    assert cb.cached_prefix([first]) == 1
    assert cb.forget_loaded([(first, cb.table(1)[0])]) == {cb.table(1)[0]}
    assert cb.cached_prefix([first]) == 0 and cb.stats.load_failures == 1
