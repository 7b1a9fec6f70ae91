"""The draft-model proposer (spec/draft.py) on tiny random models: its drafts are the draft model's own
greedy continuation, its KV follows the sequence through rollbacks and evictions, a draft with another
tokenizer is refused, and an engine speculating with a model draft samples exactly the target's
distribution (chi-square) and gives plain greedy decoding's text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import threading
from collections import Counter

import mlx.core as mx
import mlx_lm
import pytest

from meshlm.app import build_engine
from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServeConfig, SpeculativeConfig
from meshlm.engine.request import SamplingParams, Sequence, StepOutput
from meshlm.engine.sampler import SeqSampling, filter_logits
from meshlm.executor.rank import build_rank
from meshlm.model import demo
from meshlm.model.loader import load_model
from meshlm.spec.draft import DraftModel, DraftRow, load_draft, tokenizer_mismatch

BS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return demo.make_tiny(tmp_path_factory.mktemp("target"), "llama", layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Unrelated weights, the same tokenizer: a draft that is rarely right."""
    return demo.make_tiny(tmp_path_factory.mktemp("other"), "llama", layers=1, hidden=32, heads=2, kv_heads=1,
                          seed=7)


def draft_model(path, budget: int = 2**22) -> DraftModel:
    cfg = ModelConfig(str(path))
    rank = build_rank(load_model(cfg), cfg, CacheConfig(enabled=False, ssd=False, block_size=BS), budget)
    return DraftModel(rank, rank.max_blocks, 512)


def greedy(path, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy continuation, by stock mlx-lm without a cache."""
    model, _ = mlx_lm.load(str(path))
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt):]


def seq(uid: int, prompt: list[int], out: list[int] = ()) -> Sequence:
    s = Sequence(uid, list(prompt), SamplingParams(max_tokens=64, temperature=0))
    s.output_ids = list(out)
    return s


def row(s: Sequence, k: int) -> DraftRow:
    return DraftRow(s, SeqSampling.create(s.params), k)


PROMPTS = [[5, 17, 33, 9, 100, 7] * 2, [40, 41, 42], [300 + i for i in range(21)]]


def test_drafts_are_the_draft_models_greedy_continuation(other):
    draft = draft_model(other)
    seqs = [seq(i, p) for i, p in enumerate(PROMPTS)]
    out = draft.propose([row(s, 1 + i) for i, s in enumerate(seqs)])  # K differs per row
    for i, (s, p) in enumerate(zip(seqs, PROMPTS)):
        assert list(out[s.uid].tokens) == greedy(other, p, 1 + i)
        assert out[s.uid].probs is None  # greedy rows carry no q


def test_rollback_keeps_the_draft_kv_in_step_with_the_sequence(other):
    """Step after step with some drafts 'accepted' and others not, the incremental draft proposes what a
    fresh draft given the whole sequence proposes (its KV was trimmed to exactly what still agrees)."""
    draft = draft_model(other)
    s = seq(0, PROMPTS[0])
    for step, accepted in enumerate([0, 3, 1, 4, 2, 0]):
        drafts = list(draft.propose([row(s, 4)])[0].tokens)
        fresh = draft_model(other).propose([row(seq(9, s.all_ids), 4)])[9].tokens
        assert drafts == list(fresh), step
        # Verification took `accepted` drafts, then a token of its own that differs from the next draft.
        nxt = drafts[accepted] + 1 if accepted < len(drafts) else 11
        s.output_ids += drafts[:accepted] + [nxt % 400]


def test_a_sequence_the_draft_kv_already_holds_whole_still_drafts(other):
    """Regression: when the sequence's tokens were exactly the draft's KV (two drafts taken, the target's
    own token equal to the second: drafts cut by the token budget), the catch-up chunk was empty and the
    engine's step failed (SplitBrain: '... its table covers 2 blocks'); three such and the server exited."""
    draft = draft_model(other)
    s = seq(0, PROMPTS[0])
    drafts = list(draft.propose([row(s, 3)])[0].tokens)
    s.output_ids += drafts[:2]  # the KV holds the prompt and the first two drafts: all of the sequence
    assert list(draft.propose([row(s, 3)])[0].tokens) == greedy(other, s.all_ids, 3)


def test_a_row_drafted_then_left_out_of_the_targets_step_drafts_again(other):
    """Regression: a row drafted for a step the target then left it out of (its token budget spent, a
    pipeline's micro-batch full) came back with the sequence unchanged; the roll-back kept K-2 drafts
    it had trimmed from the KV, the next chunk started past the KV's end, and the step failed
    (SplitBrain: 'chunk starts at 6, this rank holds 2 positions'): three such and the server exited."""
    draft = draft_model(other)
    s = seq(0, PROMPTS[1], [7])
    first = list(draft.propose([row(s, 5)])[0].tokens)
    assert list(draft.propose([row(s, 5)])[0].tokens) == first == greedy(other, s.all_ids, 5)
    s.output_ids += first[:2]  # then verified, two drafts taken
    assert list(draft.propose([row(s, 5)])[0].tokens) == greedy(other, s.all_ids, 5)


def test_eviction_when_the_draft_kv_is_full(other):
    budget = 2 * 1 * 1 * BS * 16 * 4 * 6  # six blocks: K and V, 1 layer, 1 kv head, head_dim 16, fp32
    draft = draft_model(other, budget)
    assert draft.blocks.num_blocks == 6
    a, b = seq(0, list(range(10, 34))), seq(1, list(range(50, 74)))  # 4 blocks each once drafted
    assert draft.propose([row(a, 4)])[0].tokens
    assert draft.propose([row(b, 4)])[1].tokens  # a is dropped to make room
    assert list(draft.propose([row(a, 4)])[0].tokens) == greedy(other, a.all_ids, 4)  # recomputed, still right
    c = seq(2, list(range(100, 160)))  # more than the whole budget: drafts nothing, breaks nothing
    assert draft.propose([row(c, 4)]) == {}
    assert list(draft.propose([row(b, 2)])[1].tokens) == greedy(other, b.all_ids, 2)


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    bigger = load_model(ModelConfig(str(demo.make_tiny(tmp_path / "v600", "llama", vocab=600))))
    problem = tokenizer_mismatch(bigger, load_model(ModelConfig(str(target))))
    assert problem and "other ids" in problem
    assert tokenizer_mismatch(load_model(ModelConfig(str(target))), load_model(ModelConfig(str(target)))) is None


def test_a_budget_without_room_for_one_draft_block_names_the_draft(target, other):
    spec = SpeculativeConfig("draft", 3, str(other))
    with pytest.raises(ValueError, match=r"--draft-model .*: its KV: --kv-cache-memory 64 bytes holds no KV block"):
        load_draft(spec, ModelConfig(str(target)), load_model(ModelConfig(str(target))), 64, BS)


def padded(model_dir, out, rows: int):
    """`model_dir` with its embedding (and head) padded to `rows` rows, its tokenizer unchanged: as a
    family's models of different sizes often are."""
    shutil.copytree(model_dir, out)
    weights = mx.load(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            w = weights[name]
            weights[name] = mx.concatenate([w, 0.02 * mx.random.normal((rows - w.shape[0], w.shape[1]),
                                                                        key=mx.random.key(3))])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return out


def test_a_draft_padded_otherwise_is_accepted_but_not_one_whose_ids_do_not_fit(target, other, tmp_path):
    base = load_model(ModelConfig(str(target)))
    assert tokenizer_mismatch(load_model(ModelConfig(str(padded(other, tmp_path / "o600", 600)))), base) is None
    small = dataclasses.replace(base, vocab_size=500)  # fewer rows than the tokenizer's ids (a broken config)
    assert "ids up to 511" in tokenizer_mismatch(small, base)


# -- an engine with a model draft -----------------------------------------------------------------

def engine_for(target, draft_path, adaptive: bool = False):
    spec = SpeculativeConfig("draft", 3, str(draft_path), max_batch_size=64, adaptive=adaptive)
    cfg = ServeConfig(model=ModelConfig(str(target), max_model_len=256), cache=CacheConfig(enabled=False),
                      scheduler=SchedulerConfig(max_batch_size=64, max_waiting=4096, kv_cache_memory=2**26), speculative=spec)
    engine = build_engine(cfg, load_model(cfg.model))
    engine.start()
    return engine


def run_all(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in requests]
    left = [len(requests)]
    done = threading.Event()

    def collect(i):
        def emit(o: StepOutput) -> None:
            outs[i].extend(o.token_ids)
            assert o.error is None, o.error
            if o.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return emit

    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, collect(i))
    assert done.wait(120)
    return outs


@pytest.mark.parametrize("padding", ["draft", "target"])
def test_a_draft_padded_otherwise_gives_plain_greedy_decodings_text(target, other, tmp_path, padding):
    """A draft whose embedding has more rows than the target's (cut to the target's width), or fewer
    (padded with ids it never draws), drafts in the target's vocabulary; verification keeps it exact."""
    tgt = padded(target, tmp_path / "t600", 600) if padding == "target" else target
    drf = padded(other, tmp_path / "o600", 600) if padding == "draft" else other
    engine = engine_for(tgt, drf)
    try:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        got = run_all(engine, [(p, params) for p in PROMPTS])
        drafted = engine.metrics.spec_drafted._value.get()
    finally:
        engine.stop()
    assert got == [greedy(tgt, p, 10) for p in PROMPTS]
    assert drafted > 0


@pytest.mark.parametrize("fails", [2, 100])
def test_a_failing_draft_model_costs_speed_not_requests(target, other, fails):
    """A draft model's error failed the engine (a cluster's for good). Now the step decodes plainly and
    the draft starts afresh; three failures in a row and it is given up."""
    engine = engine_for(target, other, adaptive=False)
    draft = engine.speculator.draft
    real, calls = draft.propose, []

    def flaky(rows):
        calls.append(len(rows))
        if len(calls) <= fails:
            raise RuntimeError("the draft broke")
        return real(rows)

    draft.propose = flaky
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        got = run_all(engine, [(p, params) for p in PROMPTS])
        drafted = engine.metrics.spec_drafted._value.get()
        healthy = engine.problem is None
    finally:
        engine.stop()
    assert got == [greedy(target, p, 12) for p in PROMPTS] and healthy
    if fails == 2:
        assert drafted > 0 and len(calls) > 3  # recovered
    else:
        assert drafted == 0 and len(calls) == 3  # given up


@pytest.mark.parametrize("which", ["self", "other"])
def test_engine_greedy_text_equals_plain_decoding(target, other, which):
    draft_path = target if which == "self" else other
    engine = engine_for(target, draft_path)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        got = run_all(engine, [(p, params) for p in PROMPTS])
        m = engine.metrics
        drafted, accepted = m.spec_drafted._value.get(), m.spec_accepted._value.get()
    finally:
        engine.stop()
    assert got == [greedy(target, p, 12) for p in PROMPTS]
    assert drafted > 0
    assert accepted == drafted if which == "self" else accepted < drafted / 2


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the upper 1e-3 quantile of chi-square with df degrees of freedom."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded"])
@pytest.mark.parametrize("which", ["self", "other"])
def test_engine_sampling_with_a_model_draft_matches_the_target_distribution(target, other, which, seeded):
    """Tokens 2 and 3 of each request come from one verify step (token 1 is the prefill's); their joint
    distribution given token 1 must be the target's, p(t2 | t1) p(t3 | t1 t2), under top-k and
    temperature. Unseeded rows verify by rejection sampling: the target as its own draft (q = p) is
    always accepted, so the bonus token is drawn; the unrelated draft's top-k mostly misses the target's,
    so drafts are rejected and the residual is drawn. Seeded rows accept a draft when it equals their
    own draw at that position (spec/rejection.py). Chi-square at a 1e-3 false-failure rate; the seeds are
    fixed (the unseeded ones by `random`'s), so the run is deterministic."""
    prompt = [5, 17, 33, 9]
    base = dict(max_tokens=3, temperature=0.8, top_k=3, ignore_eos=True)
    model, _ = mlx_lm.load(str(target))
    probs = {}

    def p(prefix: tuple[int, ...]):
        if prefix not in probs:
            row = filter_logits(model(mx.array([prompt + list(prefix)]))[0, -1], SamplingParams(**base))
            probs[prefix] = mx.softmax(row).tolist()
        return probs[prefix]

    n = 1500
    engine = engine_for(target, target if which == "self" else other)
    try:
        random.seed(11)
        outs = run_all(engine, [(prompt, SamplingParams(seed=s if seeded else None, **base)) for s in range(n)])
        drafted, accepted = engine.metrics.spec_drafted._value.get(), engine.metrics.spec_accepted._value.get()
    finally:
        engine.stop()
    assert drafted > n / 2
    if seeded:  # a draft drawn from q = p equals the target's own draw with probability sum(p^2)
        assert 0 < accepted < drafted if which == "self" else accepted < drafted / 4
    else:
        assert accepted == drafted if which == "self" else accepted < drafted / 4
    seen = Counter(tuple(o) for o in outs)
    firsts = Counter(o[0] for o in outs)
    expected = {}
    for t1, count in firsts.items():
        for t2, p2 in enumerate(p((t1,))):
            if p2 > 0:
                for t3, p3 in enumerate(p((t1, t2))):
                    if p3 > 0:
                        expected[(t1, t2, t3)] = count * p2 * p3
    assert set(seen) <= set(expected)  # never outside top-k
    big = [c for c, e in expected.items() if e >= 5]
    chi2 = sum((seen[c] - expected[c]) ** 2 / expected[c] for c in big)
    df = len(big) - len(firsts)
    assert chi2 < chi2_critical(df), (chi2, df)


def test_tokens_after_a_stop_string_in_an_accepted_run_are_not_counted(target):
    """The speculation metrics counted a whole accepted run although a stop string inside it dropped the
    rest (review helper-39): emitted and accepted now count what the client was shown."""
    engine = engine_for(target, target)  # the target drafts for itself: every draft is accepted
    try:
        prompt = PROMPTS[0]
        tokens = greedy(target, prompt, 12)
        tok = engine.tokenizer
        # a stop string ending on the third output token: inside the first verified run (tokens 1-4)
        i = next(i for i in range(2, 8) if (t := tok.decode([tokens[i]]).strip())
                 and t not in tok.decode(tokens[:i]))
        stop = tok.decode([tokens[i]]).strip()
        params = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
        (out,) = run_all(engine, [(prompt, params)])
        m = engine.metrics
        emitted, accepted = m.spec_emitted._value.get(), m.spec_accepted._value.get()
    finally:
        engine.stop()
    assert out == tokens[: i + 1]
    assert emitted == len(out) - 1 and accepted <= emitted  # the first token came from the prefill, not a verify
