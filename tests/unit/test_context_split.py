"""The context-parallel split (kv/context_split.py): each logical block of N*b positions is cut into 2N
chunks and rank i holds chunks i and 2N-1-i; split and join are inverses; counts, slots and balance."""

from __future__ import annotations

import numpy as np
import pytest

from meshlm.kv.context_split import ContextSplit, WholeRow, row_split


@pytest.mark.parametrize("n,b", [(2, 2), (2, 32), (3, 8), (4, 16)])
def test_each_block_is_2n_chunks_and_rank_i_holds_i_and_2n_minus_1_minus_i(n, b):
    half = b // 2
    for r in range(n):
        s = ContextSplit(n, r, b)
        held = s.held(0, 3 * n * b)
        for block in range(3):
            base = block * n * b
            want = list(range(base + r * half, base + (r + 1) * half))
            want += list(range(base + (2 * n - 1 - r) * half, base + (2 * n - r) * half))
            assert held[block * b:(block + 1) * b].tolist() == want


@pytest.mark.parametrize("n,b,length", [(2, 32, 16000), (3, 8, 1001), (4, 16, 5), (4, 2, 77), (2, 4, 0)])
def test_split_and_join_are_inverses(n, b, length):
    s = ContextSplit(n, 0, b)
    values = np.arange(length) * 7 + 3
    parts = s.split(values)
    assert sum(len(p) for p in parts) == length
    assert np.array_equal(s.join(parts), values)
    for r, part in enumerate(parts):
        assert np.array_equal(part, values[s.for_rank(r).held(0, length)])


@pytest.mark.parametrize("n,b", [(2, 32), (3, 8), (4, 16)])
def test_counts_slots_and_balance(n, b):
    table = tuple(range(100, 160))  # a sequence's block ids: the same on every rank
    for length in (0, 1, b // 2, b, n * b - 1, n * b, n * b + 1, 5 * n * b + 3, 40 * b):
        counts = []
        for r in range(n):
            s = ContextSplit(n, r, b)
            held = s.held(0, length)
            assert s.local_count(length) == len(held)
            counts.append(len(held))
            slots = s.slots(table, held)
            assert len(set(slots.tolist())) == len(held)  # no two positions share a slot
            # a rank's positions below any length are a prefix of its slots in each block
            blocks = held // (n * b)
            for blk in set(blocks.tolist()):
                local = slots[blocks == blk] - table[blk] * b
                assert local.tolist() == list(range(len(local)))
        assert sum(counts) == length
        assert max(counts) - min(counts) <= b // 2  # decode appends keep the ranks within half a block


def test_causal_attention_work_is_even_across_ranks():
    """Query at position p attends to p + 1 keys: over a 16K prompt the ranks' work differs by < 0.1 %."""
    n, b, length = 4, 32, 16384
    work = [int((ContextSplit(n, r, b).held(0, length) + 1).sum()) for r in range(n)]
    assert (max(work) - min(work)) / max(work) < 1e-3


@pytest.mark.parametrize("bad", [dict(ranks=2, rank=2, block_size=32), dict(ranks=2, rank=0, block_size=15),
                                 dict(ranks=0, rank=0, block_size=32)])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError):
        ContextSplit(**bad)


def test_a_whole_row_is_all_on_its_holder_at_b_positions_per_block():
    split = ContextSplit(2, 1, 4)
    assert row_split(split, -1) is split
    holder, other = row_split(split, 1), row_split(split.for_rank(0), 1)
    assert isinstance(holder, WholeRow) and holder.for_rank(0) == other
    assert holder.held(3, 9).tolist() == [3, 4, 5, 6, 7, 8] and other.held(3, 9).tolist() == []
    assert (holder.local_count(11), other.local_count(11)) == (11, 0)
    # table (7, 2, 5): positions 0-3 in block 7, 4-7 in block 2, 8- in block 5, b = 4 slots each
    assert holder.slots((7, 2, 5), np.array([0, 3, 4, 9])).tolist() == [28, 31, 8, 21]
