"""StepPlan and batch_fingerprint: the control message every rank applies and checks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshlm.engine.plan import (LOGITS_LAST, LOGITS_NONE, BlockCopy, BlockLoad, BlockSave, Chunk, NewSequence, StepPlan,
                                TableUpdate, batch_fingerprint)


def test_fingerprint_is_independent_of_dict_order():
    a = {3: 10, 1: 5, 7: 1}
    for perm in itertools.permutations(a.items()):
        assert batch_fingerprint(dict(perm)) == batch_fingerprint(a)


@pytest.mark.parametrize(
    "other",
    [
        {1: 5, 3: 11},  # one length differs
        {1: 11, 3: 5},  # lengths swapped between uids
        {1: 5},  # a sequence missing
        {1: 5, 3: 10, 4: 0},  # an extra (empty) sequence
        {2: 5, 3: 10},  # a different uid
    ],
)
def test_fingerprint_tells_batches_apart(other):
    assert batch_fingerprint(other) != batch_fingerprint({1: 5, 3: 10})


def test_fingerprint_is_a_nonzero_64_bit_int():
    # Runner skips the check for fingerprint 0, so real batches must not hash to it.
    values = {batch_fingerprint({u: n for u, n in zip(range(k), range(1, k + 1))}) for k in range(50)}
    assert len(values) == 50
    assert all(0 < v < 2**64 for v in values)


def test_plan_token_count_and_emptiness():
    assert StepPlan(step_id=0).empty and StepPlan(step_id=0).num_tokens == 0
    plan = StepPlan(
        step_id=1,
        new=(NewSequence(uid=2, cached_len=0),),
        chunks=(Chunk(1, 7, (42,), LOGITS_LAST), Chunk(2, 0, (1, 2, 3), LOGITS_NONE)),
    )
    assert plan.num_tokens == 4 and not plan.empty
    assert plan.chunks[0].sample and not plan.chunks[1].sample
    assert not StepPlan(step_id=2, removed=(5,)).empty  # a removal alone must still be sent
    assert not StepPlan(step_id=3, saves=(BlockSave(0, b"k" * 16),)).empty  # so must blocks to save
    # ... and every other change a rank applies: dropped, the ranks' tables and blocks would drift apart
    assert not StepPlan(step_id=4, tables=(TableUpdate(1, (3,)),)).empty
    assert not StepPlan(step_id=5, copies=(BlockCopy(1, 2, 4),)).empty
    assert not StepPlan(step_id=6, loads=(BlockLoad(b"k" * 16, 2),)).empty


def test_plan_is_immutable_and_compares_by_value():
    a = StepPlan(step_id=0, chunks=(Chunk(1, 0, (1, 2), LOGITS_LAST),), fingerprint=9)
    b = StepPlan(step_id=0, chunks=(Chunk(1, 0, (1, 2), LOGITS_LAST),), fingerprint=9)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step_id = 1  # type: ignore[misc]
