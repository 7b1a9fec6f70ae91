"""The sampler: greedy, seeded draws, filters (top-k/top-p/min-p), penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import pytest

from meshlm.engine.request import SamplingParams
from meshlm.engine.sampler import SeqSampling, sample

LOGITS = [2.0, 1.0, 0.0, -1.0]  # softmax: ~[0.644, 0.237, 0.087, 0.032]
CHI2_3DOF_P001 = 16.27  # chi-square critical value, 3 degrees of freedom, p = 0.001


def state(**params) -> SeqSampling:
    return SeqSampling.create(SamplingParams(**params))


def random_logits(rows: int, vocab: int = 64, seed: int = 0) -> mx.array:
    return 3.0 * mx.random.normal((rows, vocab), key=mx.random.key(seed))


def draws(logits: list[float], n: int, **params) -> Counter:
    s = state(**params)
    row = mx.array([logits])
    return Counter(sample(row, [s])[0][0] for _ in range(n))


def softmax(xs: list[float], temperature: float = 1.0) -> list[float]:
    e = [math.exp(x / temperature) for x in xs]
    return [v / sum(e) for v in e]


def chi2(counts: Counter, probs: list[float]) -> float:
    n = sum(counts.values())
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-20, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    """Logits divided by ~1e-38 overflow float32 to inf and the draw was NaN, so random: a fuzzed request
    with temperature 1e-38 got "!####" where greedy gives other text. Tiny temperatures decode greedily."""
    logits = random_logits(6, seed=5)
    want = mx.argmax(logits, axis=-1).tolist()
    for seed in range(3):
        states = [state(temperature=temperature, seed=seed) for _ in range(6)]
        assert sample(logits, states)[0] == want


@pytest.mark.parametrize("on_host", [False, True], ids=["mlx-argmax", "host-argmax"])
def test_greedy_is_argmax_per_row(on_host):
    logits = random_logits(8)
    states = [state(temperature=0.0) for _ in range(8)]
    ids, lps = sample(logits, states, on_host=on_host)
    assert ids == mx.argmax(logits, axis=-1).tolist()
    assert lps == [None] * 8
    assert all(s.counts == Counter([i]) for s, i in zip(states, ids))


def test_host_argmax_breaks_ties_as_mlx_does_on_gathered_rows():
    # Rounded logits tie often; the engine passes a gather of a step's rows (its sampled rows).
    logits = mx.round(random_logits(16, vocab=40))[mx.array([1, 4, 5, 9, 15])]
    states = [state(temperature=0.0) for _ in range(5)]
    assert sample(logits, states, on_host=True)[0] == mx.argmax(logits, axis=-1).tolist()


def test_host_argmax_leaves_what_changes_greedy_to_the_mlx_path():
    logits = mx.array([LOGITS, LOGITS])
    biased = state(temperature=0.0, logit_bias=((0, -10.0),))
    with_logprobs = state(temperature=0.0, logprobs=1)
    ids, lps = sample(logits, [biased, with_logprobs], on_host=True)
    assert ids == [1, 0] and lps[0] is None and lps[1] is not None
    # a sampled row beside greedy ones: all take the MLX path, the greedy row still its argmax
    ids, _ = sample(logits, [state(temperature=0.0), state(temperature=1.0, seed=1)], on_host=True)
    assert ids[0] == 0


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = mx.zeros((1, 50))  # uniform: every draw is pure key
    def run(seed):
        s = state(temperature=1.0, seed=seed)
        return [sample(logits, [s])[0][0] for _ in range(8)]
    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len(set(run(7))) > 1  # the key advances per token


def test_seeded_row_does_not_depend_on_its_batch_mates():
    logits = random_logits(4, seed=1) / 3.0  # flatter: draws are not all argmax
    alone = state(temperature=1.0, seed=123)
    solo = [sample(logits[:1], [alone])[0][0] for _ in range(10)]
    batched = state(temperature=1.0, seed=123)
    others = [state(temperature=1.0, seed=5), state(temperature=0.0), state(temperature=0.7, top_k=3)]
    together = [sample(logits, [batched, *others])[0][0] for _ in range(10)]
    assert together == solo
    assert len(set(solo)) > 1


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.5, "top_k": 1},
        {"temperature": 1.5, "top_p": 1e-6},
        {"temperature": 1.5, "top_p": 5e-324},  # 0 in float32: it kept no token, and id 0 was drawn
        {"temperature": 1.5, "min_p": 0.999},
    ],
    ids=["top_k=1", "top_p_tiny", "top_p_below_float32", "min_p_near_1"],
)
def test_filters_at_their_extreme_reduce_to_greedy(params):
    logits = random_logits(16, seed=2) / 3.0  # gaps between top logits well above fp noise
    states = [state(seed=i, **params) for i in range(16)]
    for _ in range(3):
        ids, _ = sample(logits, states)
        assert ids == mx.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_follows_softmax(temperature):
    counts = draws(LOGITS, 1000, temperature=temperature, seed=11)
    assert chi2(counts, softmax(LOGITS, temperature)) < CHI2_3DOF_P001, counts


def test_temperature_changes_the_distribution():
    # p(token 0): 0.455 at temperature 2, 0.964 at 0.3.
    hot, cold = draws(LOGITS, 300, temperature=2.0, seed=3), draws(LOGITS, 300, temperature=0.3, seed=3)
    assert cold[0] > 0.92 * 300 and hot[0] < 0.6 * 300


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 2},
        {"top_p": 0.8},  # 0.644 < 0.8 <= 0.644 + 0.237: the two most likely
        {"min_p": 0.2},  # 0.2 * 0.644 = 0.129: drops 0.087 and 0.032
    ],
)
def test_filters_keep_the_right_tokens_and_renormalise(params):
    counts = draws(LOGITS, 400, temperature=1.0, seed=4, **params)
    assert set(counts) == {0, 1}, counts
    # Between the survivors the odds stay e^1 : 1 (p = 0.731 for token 0, sd 0.022 here).
    assert abs(counts[0] / 400 - 0.731) < 0.07, counts


def test_presence_penalty_steers_greedy_away_from_repeats():
    logits = mx.array([[1.0, 0.9, 0.0]])
    s = state(temperature=0.0, presence_penalty=0.5)
    picks = [sample(logits, [s])[0][0] for _ in range(3)]
    # 0 once -> 0.5 < 0.9 picks 1; both seen once -> 0.5 vs 0.4 picks 0 again.
    assert picks == [0, 1, 0]
    unpenalised = state(temperature=0.0)
    assert [sample(logits, [unpenalised])[0][0] for _ in range(3)] == [0, 0, 0]


def test_frequency_penalty_grows_with_the_count():
    logits = mx.array([[1.0, 0.75, 0.0]])
    s = state(temperature=0.0, frequency_penalty=0.1)
    picks = [sample(logits, [s])[0][0] for _ in range(4)]
    # Token 0 costs 0.1 per occurrence: 1.0, 0.9, 0.8 beat 0.75, then 0.7 does not.
    assert picks == [0, 0, 0, 1]


def test_penalties_are_per_sequence():
    logits = mx.array([[1.0, 0.9, 0.0]] * 2)
    a, b = state(temperature=0.0, presence_penalty=0.5), state(temperature=0.0, presence_penalty=0.5)
    assert sample(logits[:1], [a])[0] == [0]  # only `a` has generated token 0
    assert sample(logits, [a, b])[0] == [1, 0]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_log_softmax(k):
    logits = random_logits(3, vocab=64, seed=5)
    states = [state(temperature=0.0, logprobs=k), state(temperature=1.0, seed=1, logprobs=k), state(temperature=0.0)]
    ids, lps = sample(logits, states)
    ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert lps[2] is None  # not requested
    for row in (0, 1):
        lp = lps[row]
        assert lp.token_id == ids[row]
        assert lp.logprob == pytest.approx(ref[row, ids[row]].item(), abs=1e-5)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for tid, v in lp.top:
            assert v == pytest.approx(ref[row, tid].item(), abs=1e-5)
        if k:
            assert lp.top[0][0] == mx.argmax(logits[row]).item()
    assert lps[0].logprob == pytest.approx(ref[0].max().item(), abs=1e-5)  # greedy picks the top


def test_unseeded_states_draw_independently():
    logits = mx.zeros((1, 1000))
    a, b = state(temperature=1.0), state(temperature=1.0)
    assert [sample(logits, [a])[0][0] for _ in range(3)] != [sample(logits, [b])[0][0] for _ in range(3)]


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_full_unsigned_64_bit_seed_range_is_accepted(seed):
    s = state(temperature=1.0, seed=seed)
    assert sample(mx.zeros((1, 10)), [s])[0][0] in range(10)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_any_integer_seed_is_either_rejected_up_front_or_usable(seed):
    try:
        params = SamplingParams(temperature=1.0, seed=seed)
    except ValueError:
        return  # validated: the API turns this into a 400
    SeqSampling.create(params)  # actual: TypeError from mx.random.key


def test_logit_bias_forces_and_bans_tokens():
    logits = mx.array([LOGITS])
    assert sample(logits, [state(temperature=0, logit_bias=((3, 100.0),))])[0] == [3]
    assert sample(logits, [state(temperature=0, logit_bias=((0, -100.0),))])[0] == [1]
    # Sampling too: a -100 bias makes a token practically impossible.
    counts = draws(LOGITS, 300, temperature=1.0, seed=3, logit_bias=((0, -100.0), (1, -100.0)))
    assert set(counts) <= {2, 3}


def test_repetition_penalty_covers_prompt_and_output():
    logits = mx.array([[2.0, 1.9, -1.0, -1.1]])
    s = SeqSampling.create(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0])
    assert sample(logits, [s])[0] == [1]  # the prompt's token 0: 2.0 / 2 < 1.9
    assert sample(logits, [s])[0] == [0]  # now 1 is penalised too: 1.0 > 0.95
    # Negative logits are multiplied, so a penalty never makes a seen token more likely.
    neg = SeqSampling.create(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0])
    assert sample(mx.array([[-0.5, -0.6, -0.9]]), [neg])[0] == [1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = mx.array([[5.0, 1.0, 4.0, 0.0]])  # token 0 is EOS, 2 a stop token id
    s = SeqSampling.create(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)),
                           eos_token_ids=frozenset({0}))
    assert [sample(logits, [s])[0][0] for _ in range(3)] == [1, 1, 0]


def test_allowed_token_ids_are_all_that_can_be_sampled():
    """vLLM's allowed_token_ids: every other token is masked, greedy or sampled, on the host path's
    stead too (a plain greedy row would otherwise take the raw argmax)."""
    logits = mx.array([LOGITS])
    assert sample(logits, [state(temperature=0, allowed_token_ids=(2, 3))], on_host=True)[0] == [2]
    counts = draws(LOGITS, 300, temperature=1.0, seed=5, allowed_token_ids=(1, 3))
    assert set(counts) == {1, 3} and counts[1] > counts[3]
    [tok], [lp] = sample(logits, [state(temperature=0, allowed_token_ids=(3,), logprobs=2)])
    assert tok == 3 and abs(lp.logprob) < 1e-6 and [t for t, _ in lp.top] == [3]  # others are -inf: no alternatives


def test_min_tokens_yields_when_only_banned_tokens_are_allowed():
    """allowed_token_ids holding only EOS under min_tokens: the ban would leave no token (a NaN draw)."""
    s = SeqSampling.create(SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=(0,)),
                           eos_token_ids=frozenset({0}))
    assert sample(mx.array([[1.0, 5.0, 2.0]]), [s])[0] == [0]


def test_bad_words_mask_the_token_that_would_complete_them():
    """vLLM's bad_words: a one-token word never comes; a longer one's last token is masked only right after
    the rest of it, counting drafts ahead of the state (a verify step's rows)."""
    logits = mx.array([[0.0, 5.0, 4.0, 3.0]])
    s = state(temperature=0, bad_words=((1, 2), (3,)))
    assert sample(logits, [s])[0] == [1]  # nothing before: 2 is allowed, so is 1
    assert sample(logits, [s])[0] == [1]  # after 1: 2 would complete (1, 2), so the best left is 1 again
    assert s.banned_words() == [2, 3] and s.banned_words(ahead=(0,)) == [3]
    row = mx.array([0.0, 1.0, 4.0, 5.0])
    fresh = state(temperature=0, bad_words=((1, 2), (3,)))
    fresh.record([1])
    assert sample(row[None], [fresh])[0] == [1]  # 3 always, 2 after 1: masked
    fresh.record([0, 0, 0])
    assert fresh.recent == (0,)  # only as many as the longest word needs
