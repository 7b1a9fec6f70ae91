"""Prompt logprobs (`prompt_logprobs`, OpenAI's echo): how the scheduler plans a scored prompt, how the
leader splits a step's rows into scores and samples, and an engine's scores against stock mlx-lm."""

from __future__ import annotations

import re
import threading

import mlx.core as mx
import numpy as np
import pytest

from meshlm.config import SchedulerConfig
from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Chunk, StepPlan
from meshlm.engine.engine import PromptTooLong
from meshlm.engine.prompt_scores import take_scores
from meshlm.engine.request import FinishReason, SamplingParams, Sequence
from meshlm.engine.scheduler import SCORING_ROWS, Scheduler
from meshlm.kv.blocks import BlockManager
from meshlm.kv.keys import CacheSalt
from meshlm.model.runner import StepResult

BS = 4
TOKEN = 7
SCORE_TOL = 2e-3  # against stock mlx-lm: meshlm's CPU kernels round differently (tests/integration/conftest.py)


def make_scheduler(max_tokens_per_step: int = 64, blocks: int = 256) -> Scheduler:
    config = SchedulerConfig(max_batch_size=8, max_tokens_per_step=max_tokens_per_step, max_waiting=8)
    salt = CacheSalt("f" * 24, "float32", "tp1", BS)
    return Scheduler(config, BlockManager(blocks, BS, salt), 4096, frozenset({2}))


def step(sched: Scheduler, seqs: list[Sequence]) -> StepPlan:
    """One step, playing the engine: a scoring chunk scores its positions' next prompt tokens, and a chunk
    samples only where it reaches its sequence's end."""
    by_uid = {s.uid: s for s in seqs}
    plan, _ = sched.schedule()
    sampled = {}
    for c in plan.chunks:
        seq = by_uid[c.uid]
        end = c.start + len(c.token_ids)
        if c.logits == LOGITS_ALL and seq.scoring:
            seq.scored = max(seq.scored, min(end + 1, len(seq.prompt_ids)))
        if c.sample and end == seq.num_tokens:
            sampled[c.uid] = [TOKEN]
    sched.update(plan, sampled)
    return plan


def run(sched: Scheduler, seqs: list[Sequence]) -> list[StepPlan]:
    plans = []
    while sched.has_work:
        plans.append(step(sched, seqs))
        assert len(plans) < 100
    return plans


def test_a_scored_prompt_is_computed_whole_in_chunks_with_every_positions_logits():
    sched = make_scheduler()
    run(sched, [Sequence(0, list(range(10, 50)), SamplingParams(max_tokens=1))])  # caches the prompt's blocks
    seq = Sequence(1, list(range(10, 50)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    sched.add(seq)
    plans = run(sched, [seq])
    assert seq.num_cached_tokens == 0  # no prefix-cache hit: a cached position has no logits
    assert [c.logits for p in plans for c in p.chunks] == [LOGITS_ALL, LOGITS_LAST]  # the prompt, then one decode
    assert seq.scored == 40 and len(seq.output_ids) == 2
    plain = Sequence(2, list(range(10, 50)), SamplingParams(max_tokens=1))
    sched.add(plain)
    run(sched, [plain])
    assert plain.num_cached_tokens == 39  # the scored prompt's blocks serve later requests (all but the last)


def test_scoring_chunks_hold_at_most_scoring_rows():
    sched = make_scheduler(max_tokens_per_step=1024)
    seq = Sequence(0, [5] * (SCORING_ROWS * 2 + 10), SamplingParams(max_tokens=1, prompt_logprobs=0))
    sched.add(seq)
    plans = run(sched, [seq])
    assert [len(c.token_ids) for p in plans for c in p.chunks] == [SCORING_ROWS, SCORING_ROWS, 10]
    assert seq.scored == len(seq.prompt_ids)


def test_max_tokens_zero_computes_the_prompt_and_generates_nothing():
    sched = make_scheduler()
    seq = Sequence(0, list(range(10, 30)), SamplingParams(max_tokens=0, prompt_logprobs=0))
    sched.add(seq)
    plan, _ = sched.schedule()
    finished, taken = sched.update(plan, {0: [TOKEN]})
    assert [f.reason for f in finished] == [FinishReason.LENGTH] and taken == {} and seq.output_ids == []


def test_a_recompute_after_preemption_scores_only_what_is_left():
    """Scored positions are kept across a preemption; once the whole prompt is scored, a recompute may
    hit the prefix cache like any sequence."""
    sched = make_scheduler(max_tokens_per_step=16)
    seq = Sequence(0, list(range(10, 50)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    sched.add(seq)
    plan, _ = sched.schedule()
    sched.update(plan, {})
    seq.scored = 17  # what the engine recorded for the first chunk
    sched._preempt(seq)
    plan, _ = sched.schedule()
    [c] = plan.chunks
    assert (c.start, len(c.token_ids), c.logits) == (0, 16, LOGITS_NONE)  # tokens 1..16 were scored
    sched.update(plan, {})
    plan, _ = sched.schedule()
    [c] = plan.chunks
    assert (c.start, len(c.token_ids), c.logits) == (16, 16, LOGITS_ALL)  # position 16 scores token 17
    sched.update(plan, {})
    seq.scored = 33
    while not seq.output_ids:
        step(sched, [seq])
    assert seq.scored == 40
    sched._preempt(seq)
    plan, _ = sched.schedule()
    [c] = plan.chunks
    assert c.start > 0 and c.logits != LOGITS_ALL  # the recompute starts after its cached blocks
    assert seq.num_cached_tokens == 0  # usage counts the prompt's first admission (it scored: no hits)


def test_a_token_for_a_chunk_short_of_the_end_is_refused():
    sched = make_scheduler(max_tokens_per_step=16)
    seq = Sequence(0, list(range(10, 50)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    sched.add(seq)
    plan, _ = sched.schedule()
    with pytest.raises(ValueError, match="ending at 16 of 40"):
        sched.update(plan, {0: [TOKEN]})


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_a_step_splits_into_scores_and_the_rows_that_sample():
    """A scoring chunk reaching its end (uid 0, its first two tokens scored before), a scoring chunk short of
    it (uid 1), a verify chunk (uid 2) and a plain decode row (uid 3): the sampler gets uid 0's last row,
    every verify row and the decode row; scores are the raw logits' log-softmax at each next prompt token."""
    rng = np.random.default_rng(0)
    seqs = {0: Sequence(0, [3, 4, 5, 6, 7], SamplingParams(prompt_logprobs=2), scored=3),
            1: Sequence(1, [8, 9, 10, 11, 12, 13], SamplingParams(prompt_logprobs=0)),
            2: Sequence(2, [1, 2], SamplingParams(), output_ids=[5]),
            3: Sequence(3, [1, 2], SamplingParams(), output_ids=[6])}
    plan = StepPlan(1, chunks=(Chunk(0, 1, (4, 5, 6, 7), LOGITS_ALL), Chunk(1, 0, (8, 9, 10), LOGITS_ALL),
                               Chunk(2, 2, (5, 9, 9), LOGITS_ALL), Chunk(3, 2, (6,), LOGITS_LAST)))
    uids = [0] * 4 + [1] * 3 + [2] * 3 + [3]
    logits = rng.standard_normal((len(uids), 16)).astype(np.float32)
    result, scores = take_scores(plan, StepResult(uids, mx.array(logits)), seqs.get)
    assert result.uids == [0, 2, 2, 2, 3]
    np.testing.assert_array_equal(np.array(result.logits), logits[[3, 7, 8, 9, 10]])
    lp = _log_softmax(logits)
    by_uid = {s.uid: (s.first, s.read()) for s in scores}
    first, entries = by_uid[0]  # rows at positions 2, 3 score tokens 3, 4 (6 and 7); position 4 samples
    assert first == 3 and [e.token_id for e in entries] == [6, 7]
    np.testing.assert_allclose([e.logprob for e in entries], [lp[1, 6], lp[2, 7]], atol=1e-5)
    for e, row in zip(entries, (1, 2)):
        order = np.argsort(-lp[row])
        assert [t for t, _ in e.top] == order[:2].tolist()
        assert e.rank == 1 + int((lp[row] > lp[row, e.token_id]).sum())
    first, entries = by_uid[1]  # positions 0..2 score tokens 1..3
    assert first == 1 and [e.token_id for e in entries] == [9, 10, 11] and all(e.top == () for e in entries)
    np.testing.assert_allclose([e.logprob for e in entries], [lp[4, 9], lp[5, 10], lp[6, 11]], atol=1e-5)


# -- an engine over a real model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("scores") / "tiny", "qwen3", layers=2, hidden=64)


def test_an_engine_scores_prompts_as_mlx_lm_over_chunks_and_alongside_decoding(model):
    from mlx_lm import load

    from meshlm.app import build_engine
    from meshlm.config import CacheConfig, ModelConfig, ServeConfig
    from meshlm.model.loader import load_model

    cfg = ServeConfig(model=ModelConfig(str(model), max_model_len=512), cache=CacheConfig(ssd=False, block_size=16),
                      scheduler=SchedulerConfig(max_batch_size=8, max_tokens_per_step=40, kv_cache_memory=2**24))
    engine = build_engine(cfg, load_model(cfg.model))
    engine.start()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n).tolist() for n in (100, 7, 60)]
    outs: list[list] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emit(i):
        def put(o):
            outs[i].append(o)
            if o.finish_reason is not None:
                done.release()
        return put

    try:
        for max_tokens, says in ((0, "512 tokens. However, your prompt has 513 tokens."),
                                 (1, "512 tokens (at least one must be left to generate)")):
            with pytest.raises(PromptTooLong, match=re.escape(says)):  # the engine's last line, for each way
                engine.submit([5] * (513 - max_tokens), SamplingParams(max_tokens=max_tokens), emit(0))
        engine.submit(prompts[0], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1), emit(0))
        engine.submit(prompts[1], SamplingParams(max_tokens=20, temperature=0), emit(1))  # decodes meanwhile
        engine.submit(prompts[2], SamplingParams(max_tokens=0, prompt_logprobs=0), emit(2))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    ref, _ = load(str(model))
    for i in (0, 2):
        given = [o.prompt_logprobs for o in outs[i] if o.prompt_logprobs is not None]
        assert len(given) == 1 and outs[i][-1].error is None  # once, on the first output
        logits = ref(mx.array([prompts[i]]))[0].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        want = [lp[p, prompts[i][p + 1]] for p in range(len(prompts[i]) - 1)]
        assert [e.token_id for e in given[0]] == prompts[i][1:]
        np.testing.assert_allclose([e.logprob for e in given[0]], want, atol=SCORE_TOL)
    assert sum(len(o.token_ids) for o in outs[0]) == 3 and outs[0][-1].completion_tokens == 3
    assert sum(len(o.token_ids) for o in outs[2]) == 0 and outs[2][-1].finish_reason is FinishReason.LENGTH
    assert all(o.prompt_logprobs is None for o in outs[1])
