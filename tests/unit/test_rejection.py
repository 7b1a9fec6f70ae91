"""Verification of drafts: greedy is plain greedy decoding; sampling is exactly plain sampling's
distribution (a chi-square test on the first two tokens of a small-vocabulary "model")."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from meshlm.engine.request import SamplingParams
from meshlm.engine.sampler import SeqSampling, filter_logits, process_logits, sample
from meshlm.spec.rejection import Proposal, verify

V = 8
ON_HOST = pytest.mark.parametrize("on_host", [False, True], ids=["mlx-argmax", "host-argmax"])


def rows_with_argmax(targets: list[int], vocab: int = 16) -> mx.array:
    """Logits rows whose argmax is `targets[j]` (margin 5)."""
    out = np.zeros((len(targets), vocab), dtype=np.float32)
    for j, t in enumerate(targets):
        out[j, t] = 5.0
    return mx.array(out)


def greedy_state(**kw) -> SeqSampling:
    return SeqSampling.create(SamplingParams(temperature=0, **kw))


@ON_HOST
def test_greedy_all_accepted_gives_the_bonus_token(on_host):
    [v] = verify([Proposal(rows_with_argmax([3, 4, 5, 6]), (3, 4, 5), greedy_state())], on_host=on_host)
    assert v.tokens == [3, 4, 5, 6] and v.accepted == 3


@ON_HOST
def test_greedy_none_accepted_gives_the_targets_token(on_host):
    [v] = verify([Proposal(rows_with_argmax([3, 4, 5, 6]), (9, 4, 5), greedy_state())], on_host=on_host)
    assert v.tokens == [3] and v.accepted == 0


@ON_HOST
def test_greedy_stops_at_the_first_mismatch(on_host):
    [v] = verify([Proposal(rows_with_argmax([3, 4, 5, 6]), (3, 9, 5), greedy_state())], on_host=on_host)
    assert v.tokens == [3, 4] and v.accepted == 1


@ON_HOST
@pytest.mark.parametrize("k", [0, 1])
def test_small_k(k, on_host):
    targets = [7, 8]
    [v] = verify([Proposal(rows_with_argmax(targets[: k + 1]), tuple(targets[:k]), greedy_state())], on_host=on_host)
    assert v.tokens == targets[: k + 1] and v.accepted == k


@ON_HOST
def test_rows_and_drafts_must_agree(on_host):
    with pytest.raises(ValueError):
        verify([Proposal(rows_with_argmax([1, 2]), (1, 2), greedy_state())], on_host=on_host)


def test_counts_and_logprobs_of_emitted_tokens():
    state = greedy_state(logprobs=2)
    [v] = verify([Proposal(rows_with_argmax([3, 4, 5]), (3, 4), state)])
    assert state.counts == Counter({3: 1, 4: 1, 5: 1})
    assert [lp.token_id for lp in v.logprobs] == [3, 4, 5]
    for lp in v.logprobs:
        assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob == pytest.approx(5 - math.log(math.exp(5) + 15), abs=1e-5)


def test_penalties_see_the_drafts_before_each_position():
    """Row j is processed as plain decoding would process it after the drafts before j were generated."""
    logits = mx.array(np.tile(np.eye(16, dtype=np.float32)[5] * 1.0, (3, 1)))  # token 5 leads by 1 everywhere
    params = dict(frequency_penalty=2.0)
    [v] = verify([Proposal(logits, (5, 5), greedy_state(**params))])
    plain, state = [], greedy_state(**params)
    for j in range(2):
        tokens, _ = sample(logits[j : j + 1], [state])
        plain += tokens
    assert v.tokens == plain and plain[0] == 5 and plain[1] != 5


def test_min_tokens_ban_moves_with_the_position():
    eos = 2
    logits = rows_with_argmax([eos, eos, eos])
    state = SeqSampling.create(SamplingParams(temperature=0, min_tokens=2), eos_token_ids=frozenset({eos}))
    [v] = verify([Proposal(logits, (7, 7), state)])
    assert v.tokens[0] != eos  # banned at position 0: the draft (7) is not the argmax either, so it is rejected
    state = SeqSampling.create(SamplingParams(temperature=0, min_tokens=1), eos_token_ids=frozenset({eos}))
    row0 = process_logits(logits[0], state)
    [v] = verify([Proposal(logits, (int(mx.argmax(row0).item()), eos), state)])
    assert v.tokens[:2] == [int(mx.argmax(row0).item()), eos]  # position 1 is past min_tokens: EOS allowed


# -- stochastic exactness -------------------------------------------------------------------------

def target_logits(prefix: tuple[int, ...]) -> np.ndarray:
    """A deterministic 'model' over V tokens: logits depend on the whole prefix."""
    rng = np.random.default_rng([1, *prefix])  # not hash(): str hashing is salted per process
    return (rng.normal(size=V) * 1.5).astype(np.float32)


def draft_probs(prefix: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([2, *prefix])
    p = np.exp(rng.normal(size=V))
    return (p / p.sum()).astype(np.float32)


def exact_probs(prefix: tuple[int, ...], params: SamplingParams) -> np.ndarray:
    row = filter_logits(mx.array(target_logits(prefix)), params)
    return np.array(mx.softmax(row))


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the upper 1e-3 quantile of chi-square with df degrees of freedom."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_tokens(state: SeqSampling, k: int, ngram: bool, rng: np.random.Generator) -> tuple[int, int]:
    """Generate two tokens by speculative steps from an empty prefix."""
    out: list[int] = []
    while len(out) < 2:
        prefix = tuple(out)
        if ngram:  # a fixed proposal, point mass: the likeliest tokens under the target, then a poor one
            drafts = tuple((int(np.argmax(target_logits(prefix))) + i) % V for i in range(k))
            q = None
        else:
            drafts, qs = [], []
            for _ in range(k):
                p = draft_probs(prefix + tuple(drafts))
                qs.append(p)
                drafts.append(int(rng.choice(V, p=p / p.sum())))
            drafts, q = tuple(drafts), mx.array(np.stack(qs))
        logits = mx.array(np.stack([target_logits(prefix + drafts[:j]) for j in range(k + 1)]))
        [v] = verify([Proposal(logits, drafts, state, q)])
        out += v.tokens
    return out[0], out[1]


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded"])
@pytest.mark.parametrize("ngram", [True, False], ids=["ngram", "draft-model"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
], ids=["plain", "top-k-top-p"])
def test_speculative_sampling_matches_the_target_distribution(ngram, params, seeded):
    """Joint distribution of the first two tokens against the exact p(t1) p(t2 | t1); chi-square at a
    1e-3 false-failure rate. Unseeded rows verify by rejection sampling, seeded ones by their positions'
    draws; the seed is fixed either way (the unseeded one by `random`'s), so the run is deterministic."""
    n = 2500
    random.seed(3)
    state = SeqSampling.create(dataclasses.replace(params, seed=1) if seeded else params)
    rng = np.random.default_rng(0)
    seen = Counter(two_tokens(state, 3, ngram, rng) for _ in range(n))
    p1 = exact_probs((), params)
    expected = {(a, b): n * p1[a] * exact_probs((a,), params)[b] for a in range(V) for b in range(V)}
    assert sum(c for cell, c in seen.items() if expected[cell] == 0) == 0  # never outside the kept set
    big = [cell for cell, e in expected.items() if e >= 5]
    rest_e = sum(e for cell, e in expected.items() if e < 5)
    rest_o = sum(seen[cell] for cell, e in expected.items() if e < 5)
    chi2 = sum((seen[c] - expected[c]) ** 2 / expected[c] for c in big)
    df = len(big) - 1
    assert df >= 1, "the test 'model' must spread its mass over several cells"
    if rest_e >= 5:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    assert chi2 < chi2_critical(df), (chi2, df)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=8)],
                         ids=["plain", "top-k-top-p"])
def test_a_seeded_row_emits_what_plain_seeded_sampling_draws_whatever_the_drafts(params):
    """Regression: a verify step drew its own keys (uniforms, residual, bonus), so a seeded request's text
    depended on which steps verified drafts, which depends on other traffic. Now each position draws with
    the key plain decoding draws that token with: the same text, drafted or not, whatever the drafts."""
    plain = SeqSampling.create(params)
    want: list[int] = []
    for _ in range(12):
        [tok], _ = sample(mx.array(target_logits(tuple(want)))[None], [plain])
        want.append(tok)
    rng = np.random.default_rng(5)
    for trial in range(6):
        state, got = SeqSampling.create(params), []
        while len(got) < len(want):
            k = int(rng.integers(0, 5))
            # Drafts: the plain text's next tokens, with one changed at random (or none).
            drafts = list(want[len(got): len(got) + k])
            if drafts and rng.random() < 0.5:
                drafts[int(rng.integers(len(drafts)))] = int(rng.integers(V))
            logits = mx.array(np.stack([target_logits(tuple(got) + tuple(drafts[:j])) for j in range(len(drafts) + 1)]))
            [v] = verify([Proposal(logits, tuple(drafts), state)])
            got += v.tokens
        assert got[: len(want)] == want, trial


def test_host_argmax_verifies_like_mlx_on_a_batch_of_random_rows():
    """The CPU seam: plain greedy rows verified with the host's argmax give what the MLX path gives, on
    slices of one step's logits (as the engine passes them) with ties and with drafts that match."""
    logits = mx.round(2.0 * mx.random.normal((12, 50), key=mx.random.key(3)))  # rounded: ties are common
    targets = mx.argmax(logits, axis=-1).tolist()
    spans, start = [], 0
    for k in (0, 3, 1, 4):
        drafts = tuple(targets[start : start + k - 1]) + ((targets[start + k - 1] + 1) % 50,) if k else ()
        spans.append((logits[start : start + k + 1], drafts))
        start += k + 1
    outs = [verify([Proposal(rows, d, greedy_state()) for rows, d in spans], on_host=h) for h in (False, True)]
    assert [(v.tokens, v.accepted) for v in outs[0]] == [(v.tokens, v.accepted) for v in outs[1]]
    assert [v.accepted for v in outs[0]] == [0, 2, 0, 3]


def test_processed_or_sampled_rows_keep_the_mlx_path():
    """A penalty, a logit bias or logprobs change what greedy picks or reports: on_host leaves them to MLX."""
    rows = rows_with_argmax([3, 3])
    bias = greedy_state(logit_bias=((3, -100.0),))
    [v] = verify([Proposal(rows, (4,), bias)], on_host=True)
    assert v.tokens[0] != 3
    [v] = verify([Proposal(rows, (3,), greedy_state(logprobs=1))], on_host=True)
    assert v.tokens == [3, 3] and v.logprobs is not None and len(v.logprobs) == 2


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=4), dict(temperature=1.0)],
                         ids=["greedy", "seeded", "stochastic"])
def test_a_row_with_no_token_left_takes_none_and_is_the_requests_fault(params):
    """allowed_token_ids and bad_words that exclude every token of a verified position: the row records
    nothing (no token outside the request's constraints) and its state names the fault, as plain
    sampling's `take` does; a row with a token left is verified as usual beside it."""
    empty = SeqSampling.create(SamplingParams(**params, allowed_token_ids=(3,), bad_words=((3,),)))
    fine = greedy_state(allowed_token_ids=(3, 4), bad_words=((3,),))
    bad, good = verify([Proposal(rows_with_argmax([3, 3]), (3,), empty), Proposal(rows_with_argmax([4, 4]), (4,), fine)])
    assert empty.fault is not None and "exclude every token" in empty.fault and empty.generated == 0
    assert fine.fault is None and good.tokens == [4, 4] and fine.generated == 2


def test_a_rejection_with_no_residual_mass_left_samples_the_target_not_the_whole_vocabulary():
    """max(0, p - q) can be zero everywhere only by rounding (q >= p at every token): the draw from
    log(0) rows was uniform over the whole vocabulary, top_k and allowed ids ignored (review helper-39).
    Its limit is p itself. Here q is made that large on purpose."""
    params = SamplingParams(temperature=1.0, top_k=2)
    state = SeqSampling.create(params)
    logits = mx.array(np.stack([target_logits(()) for _ in range(3)]))
    top2 = set(np.argsort(target_logits(()))[-2:].tolist())
    outside = next(t for t in range(V) if t not in top2)  # a draft the target never keeps: rejected
    q = mx.ones((2, V))
    seen = set()
    for _ in range(200):
        [v] = verify([Proposal(logits, (outside, outside), state, q)])
        seen.add(v.tokens[0])
    assert seen <= top2 and seen, seen
