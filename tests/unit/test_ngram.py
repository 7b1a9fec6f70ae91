"""The n-gram proposer: longest suffix first, latest occurrence, bounded by k and by the sequence."""

from __future__ import annotations

from meshlm.engine.request import SamplingParams, Sequence
from meshlm.spec.ngram import NgramIndex, NgramProposer


def test_proposes_what_followed_the_suffix():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]


def test_longest_match_wins_over_a_later_shorter_one():
    # suffix (7, 2, 3): its 3-gram occurred at 0..3 (followed by 4); the 2-gram (2, 3) later at 5..7 (followed by 8)
    tokens = [7, 2, 3, 4, 0, 2, 3, 8, 7, 2, 3]
    assert NgramIndex(2, 3).propose(tokens, 1) == [4]
    assert NgramIndex(2, 2).propose(tokens, 1) == [8]


def test_latest_occurrence_wins():
    assert NgramIndex(2, 2).propose([5, 6, 1, 5, 6, 2, 5, 6], 1) == [2]


def test_no_match_and_k_zero_and_short_sequences():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4], 3) == []
    assert NgramIndex(2, 4).propose([1, 2, 1, 2], 0) == []
    assert NgramIndex(2, 4).propose([1], 3) == []
    assert NgramIndex(1, 1).propose([1, 1], 3) == [1]


def test_proposal_stops_at_the_end_of_the_sequence():
    assert NgramIndex(2, 2).propose([1, 2, 9, 1, 2], 10) == [9, 1, 2]


def test_incremental_index_equals_a_fresh_one():
    seq = Sequence(0, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], SamplingParams())
    p = NgramProposer(1, 3)
    for t in [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]:
        seq.output_ids.append(t)
        assert p.propose(0, seq.tokens, 4) == NgramIndex(1, 3).propose(seq.all_ids, 4)
    p.drop(0)
    assert p.propose(0, seq.tokens, 4) == NgramIndex(1, 3).propose(seq.all_ids, 4)
