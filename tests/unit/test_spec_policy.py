"""When drafts pay: the acceptance model, the shadow measurement and the step-cost fit."""

from __future__ import annotations

import pytest

from meshlm.spec.policy import Acceptance, StepCost, expected_accepted, worth_it


def test_expected_accepted():
    assert expected_accepted(0.0, 5) == 0
    assert expected_accepted(1.0, 5) == 5
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)


def test_worth_it_depends_on_batch_and_acceptance():
    assert worth_it(0.5, 5, rows=1, tokens=1, b_over_a=0.1)
    assert not worth_it(0.05, 5, rows=1, tokens=1, b_over_a=0.1)
    assert not worth_it(0.5, 5, rows=16, tokens=16, b_over_a=0.1)  # a big batch already uses the weights well
    assert worth_it(0.95, 5, rows=16, tokens=16, b_over_a=0.1)
    assert not worth_it(0.9, 0, rows=1, tokens=1, b_over_a=0.1)


def test_a_draft_models_forwards_count_against_the_gain():
    # Three draft forwards of a model a third of the target's size cost about one target step (extra = 1).
    assert worth_it(0.9, 3, rows=1, tokens=1, b_over_a=0.1, extra=1.0)
    assert not worth_it(0.4, 3, rows=1, tokens=1, b_over_a=0.1, extra=1.0)
    assert worth_it(0.4, 3, rows=1, tokens=1, b_over_a=0.1, extra=0.0)  # the same acceptance pays with n-grams
    assert not worth_it(1.0, 3, rows=1, tokens=1, b_over_a=0.1, extra=3.0)  # the target as its own draft


def test_acceptance_follows_outcomes_and_the_shadow():
    a = Acceptance()
    for _ in range(10):
        a.observe(0, True)
    assert a.alpha < 0.05
    a.shadow = (4, 5, 6)
    a.follow([4, 5])
    a.follow([6, 7])
    assert not a.shadow and a.alpha > 0.4  # a fully matched shadow proposal: three accepted, none rejected
    a.shadow = (4, 5)
    a.follow([9])
    assert not a.shadow and a.matched == 0


def test_step_cost_fit():
    c = StepCost()
    assert c.coefficients() is None
    for t in [1, 6, 1, 6, 16, 1, 11] * 5:
        c.record(t, 0.040 + 0.004 * t)
    a, b = c.coefficients()
    assert a == pytest.approx(0.040, rel=1e-3) and b == pytest.approx(0.004, rel=1e-3)
    flat = StepCost()
    for _ in range(20):
        flat.record(4, 0.05)  # no spread in tokens: the prior ratio splits the time
    assert flat.slope_ratio() == pytest.approx(0.1)


def _copying_sequence(k_base: int, k_max: int):
    """A Speculator and a sequence that decodes a prompt copied twice over (every n-gram draft right)."""
    from meshlm.config import SpeculativeConfig
    from meshlm.engine.request import SamplingParams, Sequence
    from meshlm.metrics import Metrics
    from meshlm.spec.speculator import Speculator

    spec = Speculator(SpeculativeConfig("ngram", k_base, max_num_tokens=k_max), Metrics(), max_model_len=4096)
    text = list(range(100, 160))
    seq = Sequence(0, text + text[:3], SamplingParams(max_tokens=200, temperature=0))
    seq.num_computed_tokens = len(seq.prompt_ids) - 1  # prefilled but for the last token: decoding
    return spec, seq, text


def test_ngram_drafts_grow_while_accepted_and_fall_back_at_a_rejection():
    spec, seq, text = _copying_sequence(3, 10)
    lengths = []
    for _ in range(4):
        drafts = spec.propose([seq], lambda uid: None)[seq.uid]
        lengths.append(len(drafts))
        assert list(drafts) == text[len(seq.tokens) - len(text):][: len(drafts)]
        spec.verified(seq.uid, len(drafts), len(drafts))  # every draft accepted
        seq.output_ids.extend(text[len(seq.tokens) - len(text):][: len(drafts) + 1])
        seq.num_computed_tokens = seq.num_tokens - 1
    assert lengths == [3, 6, 10, 10]  # doubled after each full acceptance, capped by the maximum
    spec.verified(seq.uid, 10, 4)  # a rejection: back to K
    assert len(spec.propose([seq], lambda uid: None)[seq.uid]) == 3


def test_draft_growth_default_and_its_limits():
    from meshlm.config import SpeculativeConfig

    assert SpeculativeConfig("ngram", 5).grown_num_tokens == 15
    assert SpeculativeConfig("ngram", 2).grown_num_tokens == 6
    assert SpeculativeConfig("ngram", 20).grown_num_tokens == 20  # K beyond the default cap: no growth
    assert SpeculativeConfig("ngram", 5, max_num_tokens=5).grown_num_tokens == 5
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", 5, max_num_tokens=4)


def test_drafts_accepted_after_a_stop_are_not_counted_as_accepted():
    # A stop among the accepted drafts (an EOS the target agreed on) drops the rest: the metrics counted
    # five accepted for one token emitted.
    spec, seq, _ = _copying_sequence(5, 5)
    spec.count(5, 5, 1)
    m = spec.metrics
    assert m.spec_accepted._value.get() == 1 and m.spec_emitted._value.get() == 1
    assert m.spec_accepted_at.labels(position="1")._value.get() == 0
