"""The scheduler without a model: token accounting, batching, preemption, finishing.

`make_scheduler` builds one in microseconds; `step` plays the runner and the
sampler (every chunk that reaches the end of its sequence gets a token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from meshlm.config import SchedulerConfig
from meshlm.engine.plan import StepPlan, batch_fingerprint
from meshlm.engine.request import FinishReason, SamplingParams, Sequence, SeqStatus
from meshlm.engine.scheduler import Finished, QueueFull, Scheduler
from meshlm.engine.step_work import MIN_CHUNK, StepWork
from meshlm.kv.blocks import BlockManager

EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise


def make_scheduler(
    max_batch_size: int = 8,
    max_tokens_per_step: int = 64,
    max_waiting: int = 64,
    kv_budget: int = 10_000,
    max_model_len: int = 1_000,
    eos: frozenset[int] = frozenset({EOS}),
    work: StepWork | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step, max_waiting=max_waiting
    )
    # One-token blocks: the KV budget counts tokens exactly, as these tests reason in tokens.
    return Scheduler(config, BlockManager(kv_budget, 1), max_model_len, eos, work)


def make_seq(uid: int, prompt_len: int = 4, **params) -> Sequence:
    params.setdefault("max_tokens", 8)
    return Sequence(uid, [100 + uid] * prompt_len, SamplingParams(**params))


def step(sched: Scheduler, token=TOKEN) -> tuple[StepPlan, list[Finished], list[Finished]]:
    """One schedule/update round; `token` is an int or a callable uid -> int."""
    plan, ended = sched.schedule()
    pick = token if callable(token) else (lambda uid: token)
    sampled = {c.uid: [pick(c.uid)] for c in plan.chunks if c.sample}
    return plan, ended, sched.update(plan, sampled)[0]


def chunk_sizes(plan: StepPlan) -> dict[int, int]:
    return {c.uid: len(c.token_ids) for c in plan.chunks}


def run_until_idle(sched: Scheduler, max_steps: int = 1_000, token=TOKEN) -> list[StepPlan]:
    plans = []
    while sched.has_work:
        assert len(plans) < max_steps, "scheduler did not drain"
        plans.append(step(sched, token)[0])
    return plans


# -- continuous batching -------------------------------------------------------


def test_new_sequence_is_sent_in_full_once_then_as_diffs():
    sched = make_scheduler()
    seq = make_seq(0, prompt_len=5, max_tokens=3, temperature=0.5)
    sched.add(seq)
    plan, _, _ = step(sched)
    assert [(n.uid, n.cached_len) for n in plan.new] == [(0, 0)]
    assert [(t.uid, len(t.blocks)) for t in plan.tables] == [(0, 5)]
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.token_ids, chunk.sample) == (0, tuple(seq.prompt_ids), True)
    assert seq.output_ids == [TOKEN] and seq.status is SeqStatus.RUNNING
    plan, _, _ = step(sched, token=9)
    assert plan.new == ()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.token_ids, chunk.sample) == (5, (TOKEN,), True)  # last sampled token
    assert seq.output_ids == [TOKEN, 9] and seq.num_computed_tokens == 6


def test_sequences_join_and_leave_between_steps():
    sched = make_scheduler()
    a, b = make_seq(0, max_tokens=3), make_seq(1, max_tokens=3)
    sched.add(a)
    step(sched)
    sched.add(b)  # arrives while `a` decodes
    plan, _, _ = step(sched)
    assert [n.uid for n in plan.new] == [1] and chunk_sizes(plan) == {0: 1, 1: 4}
    plan, _, finished = step(sched)
    assert [(f.seq.uid, f.reason) for f in finished] == [(0, FinishReason.LENGTH)]
    plan, _, _ = step(sched)
    assert plan.removed == (0,) and chunk_sizes(plan) == {1: 1}  # `a` left, `b` goes on
    assert [s.uid for s in sched.running] == [1]
    plan, _, _ = step(sched)
    assert plan.removed == (1,) and plan.chunks == () and not sched.has_work
    assert a.output_ids == b.output_ids == [TOKEN] * 3


def test_chunked_prefill_respects_max_tokens_per_step():
    sched = make_scheduler(max_tokens_per_step=16)
    seq = make_seq(0, prompt_len=50, max_tokens=2)
    sched.add(seq)
    chunks = [step(sched)[0].chunks for _ in range(4)]
    assert [(c.start, len(c.token_ids), c.sample) for (c,) in chunks] == [
        (0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)
    ]
    assert sum((c.token_ids for (c,) in chunks), ()) == tuple(seq.prompt_ids)
    assert seq.output_ids == [TOKEN]  # sampled only when the prompt was complete


def test_long_prompt_never_starves_running_decodes():
    sched = make_scheduler(max_tokens_per_step=8)
    decoders = [make_seq(0, max_tokens=50), make_seq(1, max_tokens=50)]
    for s in decoders:
        sched.add(s)
    step(sched)
    long = make_seq(2, prompt_len=40, max_tokens=5)
    sched.add(long)
    prefill_steps = 0
    while long.num_computed_tokens < 40:
        before = [s.num_tokens for s in decoders]
        left = 40 - long.num_computed_tokens
        plan, _, _ = step(sched)
        assert plan.num_tokens <= 8
        # Every decode gets its token first; the prompt gets what is left of the budget.
        assert [(c.uid, len(c.token_ids)) for c in plan.chunks[:2]] == [(0, 1), (1, 1)]
        assert chunk_sizes(plan)[2] == min(6, left)
        assert [s.num_tokens for s in decoders] == [n + 1 for n in before]
        prefill_steps += 1
    assert prefill_steps == 7  # ceil(40 / 6)
    assert long.output_ids == [TOKEN]


def test_max_batch_size_is_respected():
    sched = make_scheduler(max_batch_size=2, max_tokens_per_step=64)
    seqs = [make_seq(i, max_tokens=2 + i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    admitted_at = {}
    for n, plan in enumerate(run_until_idle(sched)):
        assert len(sched.running) <= 2
        assert len({c.uid for c in plan.chunks}) <= 2
        admitted_at.update({new.uid: n for new in plan.new})
    assert sorted(admitted_at) == [0, 1, 2, 3, 4]
    assert admitted_at[2] > admitted_at[1]  # admitted only once a slot was free
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_bounded_waiting_queue_raises_queue_full():
    sched = make_scheduler(max_waiting=2, max_batch_size=1, max_tokens_per_step=4)
    sched.add(make_seq(0))
    sched.add(make_seq(1))
    with pytest.raises(QueueFull):
        sched.add(make_seq(2))
    assert len(sched.waiting) == 2
    step(sched)  # admits one: room again
    sched.add(make_seq(2))
    with pytest.raises(QueueFull):
        sched.add(make_seq(3))


# -- aborts ----------------------------------------------------------------------


def test_abort_waiting_sequence_ends_without_running():
    sched = make_scheduler(max_batch_size=1)
    a, b = make_seq(0), make_seq(1)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.abort(1)
    plan, ended, _ = step(sched)
    assert [(f.seq.uid, f.reason) for f in ended] == [(1, FinishReason.ABORT)]
    assert b.finished and b.finish_reason is FinishReason.ABORT and b not in sched.waiting
    assert 1 not in plan.removed  # it never had KV
    assert all(c.uid == 0 for p in run_until_idle(sched) for c in p.chunks)


def test_abort_running_sequence_is_removed_in_next_plan():
    sched = make_scheduler()
    a, b = make_seq(0, max_tokens=20), make_seq(1, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    sched.abort(0)
    plan, ended, _ = step(sched)
    assert [(f.seq.uid, f.reason) for f in ended] == [(0, FinishReason.ABORT)]
    assert plan.removed == (0,) and chunk_sizes(plan) == {1: 1}
    assert a.finished and a.output_ids == [TOKEN] * 2
    assert plan.fingerprint == batch_fingerprint({1: b.num_computed_tokens})
    assert step(sched)[0].removed == ()  # removed once only


def test_abort_of_finished_or_unknown_sequence_is_a_no_op():
    sched = make_scheduler()
    a = make_seq(0, max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.finish_reason is FinishReason.LENGTH
    sched.abort(0)
    sched.abort(12345)
    plan, ended, _ = step(sched)
    assert ended == [] and a.finish_reason is FinishReason.LENGTH and plan.removed == (0,)


# -- KV budget and preemption ----------------------------------------------------------


def test_newest_sequence_is_preempted_when_kv_is_full_and_recomputed_later():
    # 20 KV tokens: both 8-token prompts fit, but both cannot grow by 10.
    sched = make_scheduler(kv_budget=20, max_model_len=20)
    a, b = make_seq(0, prompt_len=8, max_tokens=10), make_seq(1, prompt_len=8, max_tokens=10)
    sched.add(a)
    sched.add(b)
    token = iter(range(1000, 2000))
    plans = []
    while not b.num_preemptions:
        plans.append(step(sched, token=lambda uid: next(token))[0])
        assert sched.blocks.num_used <= 20
    assert a.num_preemptions == 0 and b.status is SeqStatus.WAITING
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b and sched.num_preemptions == 1
    preempt_plan = plans[-1]
    assert 1 in preempt_plan.removed and 1 not in chunk_sizes(preempt_plan)
    assert chunk_sizes(preempt_plan) == {0: 1}  # the older sequence keeps decoding
    kept = list(b.output_ids)
    assert kept  # it had generated before it was preempted
    # Later it is admitted again and its prompt *and* output are run from position 0.
    while not any(n.uid == 1 for n in plans[-1].new):
        plans.append(step(sched, token=lambda uid: next(token))[0])
    (recompute,) = [c for c in plans[-1].chunks if c.uid == 1]
    assert recompute.start == 0 and recompute.token_ids == tuple(b.prompt_ids + kept) and recompute.sample
    assert a.finished  # readmitted only once the older sequence left
    run_until_idle(sched, token=lambda uid: next(token))
    assert b.finish_reason is FinishReason.LENGTH and len(b.output_ids) == 10
    assert b.output_ids[: len(kept)] == kept
    assert a.finish_reason is FinishReason.LENGTH and len(a.output_ids) == 10


def test_a_sequence_finished_while_preempted_leaves_the_queue_and_is_never_admitted_again():
    """The engine plans step t+1 before it reads step t's text: that plan can preempt a sequence whose
    tokens then hold a stop string, and the engine finishes it while it waits. It was admitted again,
    ran untracked, and its empty chunk failed the whole batch ('SplitBrain')."""
    sched = make_scheduler(kv_budget=20, max_model_len=20)
    a, b = make_seq(0, prompt_len=8, max_tokens=10), make_seq(1, prompt_len=8, max_tokens=10)
    sched.add(a)
    sched.add(b)
    token = iter(range(1000, 2000))
    while not b.num_preemptions:
        step(sched, token=lambda uid: next(token))
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    sched.finish(b, FinishReason.STOP)  # its stop string, found after the preempting plan
    plans = run_until_idle(sched, token=lambda uid: next(token))
    assert all(n.uid != 1 for p in plans for n in p.new) and all(c.uid != 1 for p in plans for c in p.chunks)
    assert not sched.waiting and b.finish_reason is FinishReason.STOP
    assert a.finish_reason is FinishReason.LENGTH and len(a.output_ids) == 10


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_prompt_filling_the_whole_kv_store_with_nothing_to_generate_is_admitted(block_size):
    """Echo with max_tokens 0 of a prompt as long as the context, itself the whole KV store: admission
    asked for one position more (the next token's), so it waited at the head of the queue for ever and
    every request behind it too."""
    config = SchedulerConfig(max_batch_size=8, max_tokens_per_step=64, max_waiting=64)
    sched = Scheduler(config, BlockManager(16 // block_size, block_size), 16, frozenset({EOS}))  # 16 positions
    full, after = make_seq(0, prompt_len=16, max_tokens=0), make_seq(1, prompt_len=3, max_tokens=2)
    sched.add(full)
    sched.add(after)
    run_until_idle(sched, max_steps=20)
    assert full.finish_reason is FinishReason.LENGTH and full.output_ids == []
    assert after.finish_reason is FinishReason.LENGTH and len(after.output_ids) == 2
    blocks = BlockManager(16 // block_size, block_size)
    assert blocks.can_admit(16, reach=16) and not blocks.can_admit(16, reach=17) and not blocks.can_admit(16)


def test_admission_waits_for_room_for_the_whole_prompt():
    sched = make_scheduler(kv_budget=20, max_model_len=20, max_tokens_per_step=64)
    a, b = make_seq(0, prompt_len=12, max_tokens=3), make_seq(1, prompt_len=8, max_tokens=3)
    sched.add(a)
    sched.add(b)
    plan, _, _ = step(sched)
    # 12 + 1 reserved for `a`; `b` needs 8 + 1 > 7 left: it waits rather than thrash.
    assert [n.uid for n in plan.new] == [0] and b.status is SeqStatus.WAITING
    run_until_idle(sched)
    assert sched.num_preemptions == 0
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("context", [False, True], ids=["blocks", "context-blocks"])
def test_a_prompt_needing_every_block_is_admitted_though_it_shares_part_of_a_cached_one(context):
    """Regression (a hang): admission counted a partial hit's lender as free, the match then held it for the
    copy, the allocation failed, and the sequence waited to find the same lender next step, for ever; so did
    every request queued behind it. Where the lender would leave too few blocks, there is no partial hit.
    The same through context parallelism's blocks (--cp-min-tokens), whose match once dropped the length
    the guard needs."""
    from meshlm.kv.context_blocks import ContextBlocks
    from meshlm.kv.keys import CacheSalt

    config = SchedulerConfig(max_batch_size=8, max_tokens_per_step=1024, max_waiting=64)
    blocks = BlockManager(8, 16, CacheSalt("f" * 24, "float32", "tp1", 16))
    if context:  # every prompt of 4 tokens or more split over two ranks: the prefix cache looks them up
        blocks = ContextBlocks(blocks, 2, 8, min_tokens=4)
    sched = Scheduler(config, blocks, 128, frozenset({EOS}))
    a = Sequence(0, list(range(10, 30)), SamplingParams(max_tokens=1))  # caches its first block
    sched.add(a)
    run_until_idle(sched)
    b = Sequence(1, a.prompt_ids[:8] + list(range(100, 212)), SamplingParams(max_tokens=1))  # all 8 blocks
    c = Sequence(2, list(range(300, 305)), SamplingParams(max_tokens=1))
    sched.add(b)
    sched.add(c)
    plans = run_until_idle(sched, max_steps=20)
    assert b.finish_reason is c.finish_reason is FinishReason.LENGTH
    assert not any(p.copies for p in plans)
    # With a block to spare, the same prompt takes the partial hit.
    d = Sequence(3, a.prompt_ids[:8] + list(range(100, 196)), SamplingParams(max_tokens=1))  # 104 tokens: 7 blocks
    sched.add(d)
    assert any(p.copies for p in run_until_idle(sched, max_steps=20))


def test_cached_tokens_count_the_prompts_first_admission_not_a_recomputes_lookup():
    """Regression: a preempted sequence's re-admission set cached_tokens to its lookup's hits, which cover
    generated tokens too: usage said 32 cached of a 20-token prompt."""
    from meshlm.kv.keys import CacheSalt

    config = SchedulerConfig(max_batch_size=8, max_tokens_per_step=1024, max_waiting=64)
    sched = Scheduler(config, BlockManager(64, 4, CacheSalt("f" * 24, "float32", "tp1", 4)), 256, frozenset({EOS}))
    sched.add(Sequence(0, list(range(10, 30)), SamplingParams(max_tokens=1)))
    run_until_idle(sched)
    seq = Sequence(1, list(range(10, 30)), SamplingParams(max_tokens=30))
    sched.add(seq)
    for _ in range(20):
        step(sched)
    assert seq.num_cached_tokens == 19 and len(seq.output_ids) > 12  # 4 whole blocks and 3 tokens of a fifth
    sched._preempt(seq)
    step(sched)  # re-admitted: its lookup finds prompt and output blocks
    assert seq.num_computed_tokens > 20 and seq.num_cached_tokens == 19


def test_a_lookup_that_admits_nothing_is_not_counted_again_each_step():
    """A prompt with a cached prefix waiting for the step's work (or for KV room) is looked up every step:
    each lookup counted its RAM hits, so the hit counters grew while nothing was served from the cache."""
    from meshlm.kv.keys import CacheSalt

    blocks = BlockManager(512, 4, CacheSalt("f" * 24, "float32", "tp1", 4))
    config = SchedulerConfig(max_batch_size=8, max_tokens_per_step=64, max_waiting=64)
    sched = Scheduler(config, blocks, 4096, frozenset({EOS}), StepWork(keys_per_token=4, reference_context=0))
    prefix = list(range(10, 410))
    sched.add(Sequence(0, prefix + [7], SamplingParams(max_tokens=1)))
    run_until_idle(sched)
    sched.add(Sequence(1, [5] * 300, SamplingParams(max_tokens=1)))  # takes each step's prompt work first
    step(sched)
    waiting = Sequence(2, prefix + [8, 9], SamplingParams(max_tokens=1))  # 100 cached blocks
    sched.add(waiting)
    before = blocks.stats.hits_ram
    for _ in range(5):
        step(sched)
        assert waiting in sched.waiting  # no work left for a chunk past its cached prefix
    assert blocks.stats.hits_ram == before
    run_until_idle(sched)
    assert blocks.stats.hits_ram == before + 100 and waiting.num_cached_tokens == 400  # counted once, when admitted


# -- finishing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,tokens,reason,n_out",
    [
        ({"max_tokens": 10}, [5, 6, EOS, 9], FinishReason.STOP, 3),
        ({"max_tokens": 10, "ignore_eos": True}, [5, EOS, 6, EOS], FinishReason.LENGTH, 10),
        ({"max_tokens": 3}, [5, 6, 7, 8], FinishReason.LENGTH, 3),
        ({"max_tokens": 10, "stop_token_ids": (42,)}, [5, 42, 6], FinishReason.STOP, 2),
        ({"max_tokens": 1}, [EOS], FinishReason.STOP, 1),  # EOS beats LENGTH on the same token
    ],
    ids=["eos", "ignore_eos", "max_tokens", "stop_token_ids", "eos_at_max_tokens"],
)
def test_finish_reasons(params, tokens, reason, n_out):
    sched = make_scheduler()
    seq = make_seq(0, **params)
    sched.add(seq)
    stream = iter(tokens * 10)
    finished = []
    while not finished:
        finished = step(sched, token=lambda uid: next(stream))[2]
    assert [(f.seq.uid, f.reason) for f in finished] == [(0, reason)]
    assert seq.finish_reason is reason and len(seq.output_ids) == n_out
    assert seq.output_ids == (tokens * 10)[:n_out]
    plan, _, _ = step(sched)
    assert plan.removed == (0,) and plan.chunks == ()


def test_finish_at_max_model_len():
    sched = make_scheduler(max_model_len=10)
    seq = make_seq(0, prompt_len=7, max_tokens=100)
    sched.add(seq)
    run_until_idle(sched)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_tokens == 10 and len(seq.output_ids) == 3


def test_eos_ids_are_per_scheduler():
    sched = make_scheduler(eos=frozenset())
    seq = make_seq(0, max_tokens=4)
    sched.add(seq)
    run_until_idle(sched, token=EOS)
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_ids == [EOS] * 4


def test_fingerprint_is_batch_fingerprint_of_lengths_after_the_step():
    sched = make_scheduler(max_tokens_per_step=10)
    for i, n in enumerate([3, 25, 4]):
        sched.add(make_seq(i, prompt_len=n, max_tokens=6))
    for _ in range(8):
        plan, _, _ = step(sched)
        expected = {s.uid: s.num_computed_tokens for s in sched.running}
        assert plan.fingerprint == batch_fingerprint(expected)


def test_fail_all_finishes_everything_with_error():
    sched = make_scheduler(max_batch_size=1)
    a, b = make_seq(0), make_seq(1)
    sched.add(a)
    sched.add(b)
    step(sched)
    failed = sched.fail_all()
    assert {s.uid for s in failed} == {0, 1}
    assert a.finish_reason is b.finish_reason is FinishReason.ERROR
    assert not sched.running and not sched.waiting


# -- the whole loop, property style ------------------------------------------------------------


@dataclass
class Mirror:
    """What a worker rank holds: uid -> tokens in KV, updated only from plans."""

    kv: dict[int, int] = field(default_factory=dict)

    def apply(self, plan: StepPlan) -> None:
        for uid in plan.removed:
            assert uid in self.kv, f"removed {uid} never held"
            del self.kv[uid]
        new = {n.uid: n.cached_len for n in plan.new}
        for uid, cached in new.items():
            assert uid not in self.kv, f"{uid} sent as new twice"
            self.kv[uid] = cached
        for c in plan.chunks:
            assert c.uid in self.kv, f"chunk for unknown {c.uid}"
            assert c.start == self.kv[c.uid], "chunk does not continue the KV"
            self.kv[c.uid] += len(c.token_ids)
        assert plan.fingerprint == batch_fingerprint(self.kv)


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_invariants(seed):
    rng = random.Random(seed)
    max_model_len = rng.randint(16, 64)
    cfg = dict(
        max_batch_size=rng.randint(1, 6),
        max_tokens_per_step=rng.randint(6, 40),
        max_waiting=1_000,
        kv_budget=max_model_len + rng.randint(0, max_model_len),  # the app never sets it below max_model_len
        max_model_len=max_model_len,
    )
    cfg["max_tokens_per_step"] = max(cfg["max_tokens_per_step"], cfg["max_batch_size"])
    sched = make_scheduler(**cfg)
    mirror = Mirror()
    seqs: list[Sequence] = []
    arrivals = sorted(rng.randint(0, 30) for _ in range(rng.randint(5, 20)))
    t = 0
    while arrivals or sched.has_work:
        while arrivals and arrivals[0] <= t:
            arrivals.pop(0)
            seq = Sequence(
                len(seqs),
                [rng.randint(3, 99) for _ in range(rng.randint(1, max_model_len - 1))],
                SamplingParams(max_tokens=rng.randint(1, 30), stop_token_ids=(1,) if rng.random() < 0.5 else ()),
            )
            seqs.append(seq)
            sched.add(seq)
        if seqs and rng.random() < 0.03:
            sched.abort(rng.choice(seqs).uid)
        decoding = {s.uid for s in sched.running if s.remaining == 1 and not s.finished and not s.aborted}
        before = {s.uid: (s.num_computed_tokens, list(s.all_ids)) for s in sched.running}
        plan, ended = sched.schedule()
        mirror.apply(plan)
        assert plan.num_tokens <= cfg["max_tokens_per_step"]
        assert len(sched.running) <= cfg["max_batch_size"]
        assert sum(mirror.kv.values()) <= cfg["kv_budget"]
        sizes = chunk_sizes(plan)
        for c in plan.chunks:
            seq = seqs[c.uid]
            assert c.token_ids == tuple(seq.all_ids[c.start : c.start + len(c.token_ids)])
            assert c.sample == (c.start + len(c.token_ids) == seq.num_tokens)
            if c.uid in before and c.uid not in {n.uid for n in plan.new}:
                assert c.start == before[c.uid][0]
        # A decoding sequence either advances by one token or was preempted (never starved).
        for uid in decoding:
            assert sizes.get(uid) == 1 or uid in plan.removed, (uid, plan)
        # A partial prefill chunk takes what is left, so nothing is scheduled after it.
        partial = [i for i, c in enumerate(plan.chunks) if not c.sample]
        assert partial in ([], [len(plan.chunks) - 1])
        sampled = {c.uid: [rng.choice([1, EOS]) if rng.random() < 0.04 else rng.randint(3, 99)]
                   for c in plan.chunks if c.sample}
        outputs = {s.uid: list(s.output_ids) for s in seqs}
        sched.update(plan, sampled)
        assert sched.blocks.num_used <= cfg["kv_budget"]
        for s in seqs:
            assert len(s.output_ids) <= s.params.max_tokens
            assert s.num_tokens <= max_model_len
            # Output only grows, by the sampled token: preemption never loses generated text.
            assert s.output_ids == outputs[s.uid] + (sampled[s.uid] if s.uid in sampled else [])
        t += 1
        assert t < 3_000, "no progress"
    assert not mirror.kv  # every rank freed everything
    assert all(s.finished for s in seqs)
    for s in seqs:
        if s.finish_reason is FinishReason.STOP:
            assert s.output_ids[-1] in (EOS, *s.params.stop_token_ids)
        elif s.finish_reason is FinishReason.LENGTH:
            assert len(s.output_ids) == s.params.max_tokens or s.num_tokens == max_model_len
        else:
            assert s.finish_reason is FinishReason.ABORT and s.aborted


# -- speculative decoding ------------------------------------------------------------------------

def _spec_sched(kv_budget: int = 64, block_size: int = 4) -> Scheduler:
    config = SchedulerConfig(max_batch_size=4, max_tokens_per_step=64, max_waiting=8)
    return Scheduler(config, BlockManager(kv_budget // block_size, block_size), 256, frozenset({EOS}))


def _prefill(sched: Scheduler, seq: Sequence) -> None:
    sched.add(seq)
    plan, _ = sched.schedule()
    sched.update(plan, {seq.uid: [TOKEN]})


def test_drafts_become_one_chunk_with_logits_for_every_position():
    from meshlm.engine.plan import LOGITS_ALL

    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8, 9)})
    [c] = plan.chunks
    assert c.token_ids == (TOKEN, 7, 8, 9) and c.start == 5 and c.logits == LOGITS_ALL
    assert len(sched.blocks.table(0)) == 3  # 9 positions in blocks of 4


def test_partial_acceptance_rolls_back_in_the_next_plan():
    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8, 9)})
    finished, taken = sched.update(plan, {0: [7, 11]})  # draft 7 accepted, 8 rejected, the target said 11
    assert not finished and taken == {0: [7, 11]}
    assert seq.output_ids == [TOKEN, 7, 11] and seq.num_computed_tokens == 7
    assert len(sched.blocks.table(0)) == 2
    plan, _ = sched.schedule()
    assert [(t.uid, t.length, t.blocks) for t in plan.trims] == [(0, 7, 2)]
    assert plan.chunks[0].start == 7 and plan.chunks[0].token_ids == (11,)
    assert plan.fingerprint == batch_fingerprint({0: 8})


def test_all_accepted_needs_no_trim():
    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8)})
    sched.update(plan, {0: [7, 8, 12]})
    assert seq.num_computed_tokens == 8
    assert sched.schedule()[0].trims == ()


def test_eos_inside_an_accepted_run_ends_it_there():
    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, EOS, 9)})
    finished, taken = sched.update(plan, {0: [7, EOS, 9, 10]})
    assert taken == {0: [7, EOS]} and seq.output_ids == [TOKEN, 7, EOS]
    assert [f.reason for f in finished] == [FinishReason.STOP]
    plan, _ = sched.schedule()
    assert plan.removed == (0,) and plan.trims == ()


def test_max_tokens_inside_an_accepted_run():
    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=3)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8, 9)})
    finished, taken = sched.update(plan, {0: [7, 8, 9, 10]})
    assert taken == {0: [7, 8]} and len(seq.output_ids) == 3
    assert [f.reason for f in finished] == [FinishReason.LENGTH]


def test_drafts_give_way_when_blocks_run_out():
    sched = _spec_sched(kv_budget=8, block_size=4)  # two blocks
    seq = make_seq(0, prompt_len=6, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8, 9)})  # 10 positions do not fit in 8: plain decoding
    assert [c.token_ids for c in plan.chunks] == [(TOKEN,)]


def test_a_bad_verify_outcome_is_refused():
    sched = _spec_sched()
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    _prefill(sched, seq)
    plan, _ = sched.schedule({0: (7, 8)})
    with pytest.raises(ValueError):
        sched.update(plan, {0: [1, 2, 3, 4]})


# -- planning ahead (asynchronous scheduling) -----------------------------------


def test_a_step_planned_ahead_continues_every_decoding_sequence_and_the_plans_apply_in_order():
    sched = make_scheduler()
    a, b = make_seq(0, max_tokens=10), make_seq(1, prompt_len=6, max_tokens=2)
    sched.add(a)
    sched.add(b)
    first, _ = sched.schedule()  # both prompts, logits for their last positions
    ahead = sched.continue_ahead(first, [0, 1])
    # b's first token leaves it one short of max_tokens: it takes the step planned ahead too.
    assert [(c.uid, c.start, len(c.token_ids)) for c in ahead.chunks] == [(0, 4, 1), (1, 6, 1)]
    assert ahead.fingerprint == batch_fingerprint({0: 5, 1: 7})
    assert sched.continue_ahead(ahead, [0, 1]) is None  # `first` is not read yet: one plan ahead at most
    sched.update(first, {0: [11], 1: [12]})
    assert (a.num_computed_tokens, a.output_ids) == (4, [11])
    # b's token from `ahead` ends it by max_tokens: the next one sits it out.
    nxt = sched.continue_ahead(ahead, [0, 1])
    assert nxt is not None and [c.uid for c in nxt.chunks] == [0]
    sched.update(ahead, {0: [13], 1: [14]})
    assert (a.num_computed_tokens, a.output_ids, b.output_ids, b.finished) == (5, [11, 13], [12, 14], True)
    sched.update(nxt, {0: [15]})
    assert a.output_ids == [11, 13, 15] and a.num_computed_tokens == 6
    plan, ended = sched.schedule()  # b is reaped by a full plan
    assert plan.removed == (1,) and [c.uid for c in plan.chunks] == [0]


@pytest.mark.parametrize("case", ["arrival", "mid_prefill", "aborted", "finished", "no_blocks", "other_uids"])
def test_planning_ahead_declines_what_needs_a_full_plan(case):
    sched = make_scheduler(max_tokens_per_step=8, kv_budget=5 if case == "no_blocks" else 10_000)
    a = make_seq(0, prompt_len=4)
    sched.add(a)
    if case == "mid_prefill":
        sched.add(make_seq(1, prompt_len=12))  # 4 + 12 > 8 tokens: its prompt takes two steps
    first, _ = sched.schedule()
    uids = [c.uid for c in first.chunks if c.sample]
    if case == "arrival":
        sched.add(make_seq(2))
    elif case == "aborted":
        sched.abort(0)
    elif case == "finished":
        sched.finish(a, FinishReason.STOP)
    elif case == "no_blocks":
        ahead = sched.continue_ahead(first, uids)  # position 4 takes the fifth and last block
        sched.update(first, {0: [TOKEN]})
        first = ahead  # position 5 would need a sixth
    elif case == "other_uids":
        uids = [5]
    assert sched.continue_ahead(first, uids) is None


def test_a_pipeline_micro_batch_takes_its_share_of_the_token_budget():
    """`max_tokens` (a pipeline's share of --max-tokens-per-step) caps a plan's prefill below the step
    budget; the next micro-batch, with the first still in flight, takes the rest of the prompts (a tail
    shorter than a plan's budget waits for its chunk in flight)."""
    sched = make_scheduler(max_tokens_per_step=64)
    for uid in (1, 2):
        sched.add(make_seq(uid, prompt_len=40))
    first, _ = sched.schedule(max_tokens=32)
    assert sum(chunk_sizes(first).values()) == 32 and chunk_sizes(first) == {1: 32}
    second, _ = sched.schedule(busy=frozenset({1}), max_tokens=32)
    assert chunk_sizes(second) == {2: 32}
    sched.update(first, {})
    sched.update(second, {})
    sched.add(make_seq(3, prompt_len=100))
    third, _ = sched.schedule(max_tokens=1000)  # never above the step budget
    assert chunk_sizes(third) == {1: 8, 2: 8, 3: 48}


def test_a_prompt_in_flight_continues_in_the_next_micro_batch_by_whole_chunks():
    """A pipeline's micro-batches: the chunks of one prompt follow each other through plans in flight, each
    from where the last one in flight ends, while a whole plan's budget of prompt is left; the tail, and a
    sequence whose chunk in flight samples (a decode, the prompt's last chunk), wait for that plan."""
    sched = make_scheduler(max_tokens_per_step=64)
    sched.add(make_seq(1, prompt_len=50))
    sched.add(make_seq(2, prompt_len=2))
    plans = [sched.schedule(max_tokens=20)[0]]
    for _ in range(2):
        busy = frozenset(c.uid for p in plans for c in p.chunks)
        plans.append(sched.schedule(busy=busy, max_tokens=20)[0])
    assert [[(c.uid, c.start, len(c.token_ids), c.sample) for c in p.chunks] for p in plans] == [
        [(1, 0, 20, False)], [(1, 20, 20, False)], [(2, 0, 2, True)]]
    # Each plan's fingerprint counts the plans before it, as every rank applies them in order.
    assert plans[2].fingerprint == batch_fingerprint({1: 40, 2: 2})
    assert sched.schedule(busy=frozenset({1, 2}), max_tokens=20)[0].chunks == ()  # the tail, a token: wait
    for plan in plans:
        sched.update(plan, {c.uid: [TOKEN] for c in plan.chunks if c.sample})
    seq1 = next(s for s in sched.running if s.uid == 1)
    assert seq1.num_computed_tokens == 40 and seq1.output_ids == []
    nxt, _ = sched.schedule()
    assert [(c.uid, c.start, len(c.token_ids), c.sample) for c in nxt.chunks] == [(1, 40, 10, True), (2, 2, 1, True)]


def test_an_aborted_prompt_in_flight_is_not_read_further():
    sched = make_scheduler(max_tokens_per_step=64)
    sched.add(make_seq(1, prompt_len=50))
    first, _ = sched.schedule(max_tokens=20)
    sched.abort(1)
    second, ended = sched.schedule(busy=frozenset({1}), max_tokens=20)
    assert second.chunks == () and second.removed == (1,) and [f.seq.uid for f in ended] == [1]


# -- a step's work against long contexts (engine/step_work.py) ----------------------------------------


def test_prompt_chunks_past_the_reference_context_shrink_to_a_whole_chunks_work_there():
    work = StepWork(keys_per_token=32, reference_context=128)
    sched = make_scheduler(max_tokens_per_step=64, kv_budget=20_000, max_model_len=5_000, work=work)
    seq = make_seq(0, prompt_len=3_000, max_tokens=2)
    sched.add(seq)
    plans = run_until_idle(sched)
    chunks = [c for p in plans for c in p.chunks if c.start < 3_000]  # the prompt's
    assert sum((c.token_ids for c in chunks), ()) == tuple(seq.prompt_ids)
    # Whole chunks up to the reference context, then ever shorter ones within the limit, down to the least
    assert all(len(c.token_ids) == 64 for c in chunks if c.start <= 128)
    later = [len(c.token_ids) for c in chunks[:-1] if c.start > 128]
    assert later == sorted(later, reverse=True) and 64 > later[0] and later[-1] == MIN_CHUNK
    assert all(work.cost(c.start, len(c.token_ids)) <= work.limit(64) for c in chunks if len(c.token_ids) > MIN_CHUNK)
    assert seq.output_ids == [TOKEN, TOKEN]


def test_decode_rows_always_advance_and_a_prompt_still_gets_its_least_chunk_when_they_take_the_work():
    """Decode rows at a long context can use the whole step's work: each still gets its token, and the first
    prompt chunk MIN_CHUNK tokens (prompts always progress); a second prompt waits for a later step."""
    work = StepWork(keys_per_token=2, reference_context=0)
    sched = make_scheduler(max_tokens_per_step=64, kv_budget=20_000, max_model_len=5_000, work=work)
    decoders = [make_seq(uid, prompt_len=1_200, max_tokens=100) for uid in (0, 1)]
    for seq in decoders:
        sched.add(seq)
    while any(s.num_computed_tokens < 1_200 for s in decoders):
        step(sched)
    assert 2 * work.cost(1_200, 1) > work.limit(64)  # the decode rows alone pass the limit
    sched.add(make_seq(2, prompt_len=200))
    sched.add(make_seq(3, prompt_len=200))
    for _ in range(3):
        plan, _, _ = step(sched)
        sizes = chunk_sizes(plan)
        assert sizes[0] == sizes[1] == 1 and sizes[2] == MIN_CHUNK and 3 not in sizes


def test_without_a_work_model_chunks_are_the_token_budgets_at_any_context():
    sched = make_scheduler(max_tokens_per_step=64, kv_budget=20_000, max_model_len=5_000)
    sched.add(make_seq(0, prompt_len=3_000, max_tokens=1))
    plans = run_until_idle(sched)
    assert [len(c.token_ids) for p in plans for c in p.chunks][:-1] == [64] * (3_000 // 64)


def test_decode_rows_newer_than_a_prompt_in_progress_count_before_its_chunk():
    """A sequence admitted beside a long prompt's shortened chunk decodes after it in the batch: its row's work
    is counted first all the same, so the step stays within the limit (the step admitting it, with one
    token to run, may pass it by that token: a row is never shortened, nor kept waiting for work)."""
    work = StepWork(keys_per_token=512, reference_context=64)
    sched = make_scheduler(max_tokens_per_step=64, kv_budget=20_000, max_model_len=5_000, work=work)
    sched.add(make_seq(0, prompt_len=2_000, max_tokens=2))
    while sched.running == [] or sched.running[0].num_computed_tokens < 600:
        step(sched)
    for uid in (1, 2, 3):
        sched.add(make_seq(uid, prompt_len=1, max_tokens=500))
    checked = 0
    while sched.running[0].num_computed_tokens < 2_000 and sched.running[0].uid == 0:
        plan, _, _ = step(sched)
        chunk = plan.chunks[0]
        if chunk.uid == 0 and len(chunk.token_ids) > MIN_CHUNK and not plan.new and len(plan.chunks) == 4:
            assert sum(work.cost(c.start, len(c.token_ids)) for c in plan.chunks) <= work.limit(64)
            checked += 1
    assert checked
