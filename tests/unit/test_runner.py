"""The runner on a tiny random llama, over meshlm's KV store: batched, chunked, paged execution equals
running each sequence alone with stock mlx-lm (its own dense KVCache, its own attention), on every
attention backend.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig
from meshlm.engine.plan import (LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Chunk, NewSequence, StepPlan, TableUpdate, Trim,
                                batch_fingerprint)
from meshlm.engine.request import SamplingParams, Sequence
from meshlm.engine.scheduler import Scheduler
from meshlm.engine.step_work import StepWork, keys_per_token
from meshlm.executor.local import LocalExecutor
from meshlm.executor.rank import RankState, build_rank
from meshlm.kv.blocks import BlockManager
from meshlm.model import cpu_kernels, demo
from meshlm.model.loader import load_model
from meshlm.model import batch as batch_module
from meshlm.model import decode_layer as decode_layer_module
from meshlm.model import forward as forward_module
from meshlm.model.batch import Batch, RowSpec
from meshlm.model.runner import SplitBrain

VOCAB = 400  # ids the tiny model knows (its tokenizer has ~500)
BS = 8
NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()
BACKENDS = [
    pytest.param(("native",), id="native", marks=pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))),
    pytest.param(("mlx-cpu",), id="mlx-cpu"),
    pytest.param(("portable",), id="portable"),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return demo.make_tiny(tmp_path_factory.mktemp("tiny"), model_type="llama", seed=0)


def make_rank(path, backend: str = "native", budget: int = 2**24, block_size: int = BS,
              prefix: bool = True) -> RankState:
    cfg = ModelConfig(str(path), cpu_kernels=backend != "portable", native_kernels=backend == "native")
    return build_rank(load_model(cfg), cfg, CacheConfig(enabled=prefix, ssd=False, block_size=block_size), budget)


@pytest.fixture(scope="module")
def reference(path):
    """Greedy tokens and per-token logits of one sequence run alone by stock mlx-lm (memoised)."""
    model, _ = mlx_lm.load(str(path))
    memo: dict[tuple, tuple[list[int], list[mx.array]]] = {}

    def run(prompt: list[int], n: int):
        key = (tuple(prompt), n)
        if key not in memo:
            cache = make_prompt_cache(model)
            logits = model(mx.array([prompt]), cache=cache)[0, -1]
            tokens, rows = [], []
            for _ in range(n):
                tok = mx.argmax(logits).item()
                tokens.append(tok)
                rows.append(logits)
                logits = model(mx.array([[tok]]), cache=cache)[0, -1]
            mx.eval(rows)
            memo[key] = tokens, rows
        return memo[key]

    return run


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrival: list[int]  # step at which each sequence is submitted


def make_workload(n: int = 16, seed: int = 0) -> Workload:
    """Short prompts at step 0, then long prompts (prefilled in chunks) and short ones arriving while
    others decode; some share a long prefix (whole-block and mid-block prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(2 * BS + 3)]
    lengths = [rng.randint(1, 4) if i < 4 or i % 2 else rng.randint(18, 48) for i in range(n)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths]
    arrival = [0] * 4 + sorted(rng.randint(1, 8) for _ in range(n - 4))
    for i, cut in ((5, 3), (9, 2), (13, 1)):  # later ones find whole blocks cached, then part of one
        prompts[i] = shared[: 2 * BS + cut] + prompts[i]
    arrival[9], arrival[13] = 10, 12
    return Workload(prompts, [rng.randint(3, 10) for _ in range(n)], arrival)


@dataclass
class Run:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, list[mx.array]] = field(default_factory=dict)
    kv_bytes: list[int] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    preemptions: int = 0
    rank: RankState | None = None
    blocks: BlockManager | None = None


def drive(rank: RankState, w: Workload, *, step_tokens=16, batch=16, aborts=None, work: StepWork | None = None) -> Run:
    """The engine loop in miniature: schedule, execute, greedy-sample, update."""
    aborts = aborts or {}
    blocks = BlockManager(rank.max_blocks, rank.block_size, rank.salt, rank.ssd)
    sched = Scheduler(SchedulerConfig(max_batch_size=batch, max_tokens_per_step=step_tokens), blocks,
                      min(rank.max_blocks * rank.block_size, 4096), work=work)
    out = Run(rank=rank, blocks=blocks)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=m, temperature=0)) for i, (p, m)
            in enumerate(zip(w.prompts, w.max_tokens))]
    t = 0
    while t <= max(w.arrival) or sched.has_work:
        for s in seqs:
            if w.arrival[s.uid] == t:
                sched.add(s)
        for uid in aborts.get(t, ()):
            sched.abort(uid)
        plan, _ = sched.schedule()
        result = rank.step(plan)
        assert sorted(result.uids) == sorted(c.uid for c in plan.chunks if c.sample)
        sampled = {}
        if result.logits is not None:
            mx.eval(result.logits)
            sampled = {u: [t] for u, t in zip(result.uids, mx.argmax(result.logits, axis=-1).tolist())}
            for i, uid in enumerate(result.uids):
                out.logits.setdefault(uid, []).append(result.logits[i])
        sched.update(plan, sampled)
        out.plans.append(plan)
        out.kv_bytes.append(rank.kv_bytes)
        t += 1
        assert t < 500
    out.tokens = {s.uid: s.output_ids for s in seqs}
    out.preemptions = sched.num_preemptions
    return out


@pytest.fixture(scope="module")
def workload():
    return make_workload()


@pytest.fixture(scope="module", params=BACKENDS)
def batched(request, path, workload):
    return drive(make_rank(path, request.param[0]), workload)


def test_workload_exercises_every_runner_path(batched):
    plans = batched.plans
    decode_and_prefill = [p for p in plans if any(len(c.token_ids) == 1 for c in p.chunks)
                          and any(len(c.token_ids) > 1 for c in p.chunks)]
    assert decode_and_prefill  # one forward runs decode rows and prefill rows together
    assert any(not c.sample for p in plans for c in p.chunks)  # chunked prefill
    assert any(p.removed and p.chunks for p in plans)  # leave while others go on
    assert any(n.cached_len >= 2 * BS for p in plans for n in p.new)  # whole-block prefix hits
    assert any(p.copies for p in plans)  # a match ending inside a block: copy-on-write
    assert max(sum(len(c.token_ids) == 1 for c in p.chunks) for p in plans) >= 4


def test_batched_chunked_greedy_tokens_equal_each_sequence_alone(batched, workload, reference):
    for uid, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        assert batched.tokens[uid] == reference(prompt, n)[0], uid


def test_batched_logits_equal_single_sequence_logits(batched, workload, reference):
    worst = 0.0
    for uid, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        rows = batched.logits[uid]
        ref_rows = reference(prompt, n)[1]
        assert len(rows) == len(ref_rows) == n
        for got, want in zip(rows, ref_rows):
            worst = max(worst, mx.abs(got - want).max().item())
    assert worst < 1e-4


def test_every_block_is_released_when_every_sequence_has_left(batched):
    assert batched.blocks.num_used == 0 and not batched.rank.runner.seqs
    assert batched.blocks.num_cached > 0  # what they computed stays findable


def test_abort_mid_run_leaves_other_sequences_unchanged(path, workload, reference):
    aborts = {2: [4], 3: [2], 9: [8]}  # 4 and 8 mid-prefill, 2 mid-decode
    run = drive(make_rank(path), workload, aborts=aborts)
    assert [u for p in run.plans for u in p.removed if u in (2, 4, 8)] == [4, 2, 8]
    for uid, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        full = reference(prompt, n)[0]
        if uid in (2, 4, 8):
            assert len(run.tokens[uid]) < n and full[: len(run.tokens[uid])] == run.tokens[uid]
        else:
            assert run.tokens[uid] == full, uid
    assert run.tokens[4] == run.tokens[8] == [] and run.blocks.num_used == 0


def test_preemption_and_recompute_give_the_same_tokens(path, reference):
    rng = random.Random(0)
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(6)],
                 max_tokens=[20] * 6, arrival=[0, 0, 0, 1, 1, 2])
    rank = make_rank(path, budget=7 * make_rank(path).store.shape.block_bytes, prefix=False)  # 56 positions
    run = drive(rank, w, step_tokens=16, batch=6)
    assert run.preemptions >= 3
    # Some recompute re-ran generated tokens, not just the prompt.
    assert any(c.start == 0 and len(c.token_ids) > len(w.prompts[c.uid]) for p in run.plans for c in p.chunks)
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        assert run.tokens[uid] == reference(prompt, n)[0], uid


def test_long_rows_across_many_blocks(path, reference):
    rng = random.Random(3)
    lengths = [250, 5, 240, 300, 1, 270]
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
                 max_tokens=[12, 20, 30, 8, 15, 10], arrival=[0, 3, 4, 6, 9, 12])
    run = drive(make_rank(path), w, step_tokens=64, batch=8)
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        assert run.tokens[uid] == reference(prompt, n)[0], uid


def test_prompt_chunks_shortened_for_their_context_give_the_same_tokens_and_logits(path, reference):
    """Past --long-prefill-context (here 32 positions) a prompt's chunks shrink with the context, beside
    decode rows and other prompts: each sequence's tokens and logits are still what it gets alone."""
    rng = random.Random(5)
    lengths = [300, 4, 280, 120]
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
                 max_tokens=[10, 30, 12, 8], arrival=[0, 0, 2, 5])
    work = StepWork(keys_per_token(load_model(ModelConfig(str(path))).model.args), 32)
    run = drive(make_rank(path), w, step_tokens=64, batch=8, work=work)
    sizes = {len(c.token_ids) for p in run.plans for c in p.chunks if c.start > 64 and not c.sample}
    assert sizes and max(sizes) < 64 - 8  # shortened, not the budget's leftovers
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        tokens, logits = reference(prompt, n)
        assert run.tokens[uid] == tokens, uid
        assert max(mx.abs(a - b).max().item() for a, b in zip(run.logits[uid], logits)) < 1e-4


def test_kv_memory_stays_within_the_budget_whatever_the_mix_of_lengths(path, reference):
    """One long conversation and fifteen short ones under a budget of ~1,000 positions: the KV bytes
    allocated never exceed it (the left-padded batch of the old runner held rows x longest)."""
    rng = random.Random(0)
    lengths = [600] + [2] * 15
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
                 max_tokens=[20] * 16, arrival=[0] + [1] * 15)
    block_bytes = make_rank(path).store.shape.block_bytes
    budget = 125 * block_bytes  # 1,000 positions
    run = drive(make_rank(path, budget=budget), w, step_tokens=700, batch=16)
    assert max(run.kv_bytes) <= budget
    assert run.preemptions == 0  # 600 + 15 x 22 positions fit in 125 blocks: nothing padded
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        assert run.tokens[uid] == reference(prompt, n)[0], uid


# -- plans that do not fit this rank's state ----------------------------------------------------------


def first_plan(uid: int = 7, tokens=(5, 6, 7)) -> StepPlan:
    return StepPlan(0, new=(NewSequence(uid, 0),), chunks=(Chunk(uid, 0, tokens, LOGITS_LAST),),
                    tables=(TableUpdate(uid, (0,)),), num_blocks=1, fingerprint=batch_fingerprint({uid: len(tokens)}))


def test_fingerprint_mismatch_raises_split_brain(path):
    rank = make_rank(path)
    assert rank.step(first_plan()).uids == [7]
    for lengths in ({7: 5}, {7: 4, 8: 1}):  # the leader believes something else
        plan = StepPlan(1, chunks=(Chunk(7, 3, (9,), LOGITS_LAST),), num_blocks=1, fingerprint=batch_fingerprint(lengths))
        fresh = make_rank(path)
        fresh.step(first_plan())
        with pytest.raises(SplitBrain, match="step 1"):
            fresh.step(plan)


@pytest.mark.parametrize("plan, words", [
    (StepPlan(1, removed=(8,), num_blocks=1), "does not hold"),
    (StepPlan(1, new=(NewSequence(9, 0),), chunks=(Chunk(9, 0, (1, 2), LOGITS_LAST),),
              tables=(TableUpdate(9, (5,)),), num_blocks=2), "block id"),
    (StepPlan(1, new=(NewSequence(9, 0),), chunks=(Chunk(9, 0, (1, VOCAB + 200), LOGITS_LAST),),
              tables=(TableUpdate(9, (1,)),), num_blocks=2), "vocabulary"),
    (StepPlan(1, new=(NewSequence(9, 0),), chunks=(Chunk(9, 0, tuple(range(1, 12)), LOGITS_LAST),),
              tables=(TableUpdate(9, (1,)),), num_blocks=2), "covers 1 blocks"),
    (StepPlan(1, num_blocks=10**9), "budget"),
    (StepPlan(1, new=(NewSequence(9, 0, 1),), chunks=(Chunk(9, 0, (1, 2), LOGITS_LAST),),
              tables=(TableUpdate(9, (1,)),), num_blocks=2), "held whole by rank 1"),  # no context parallelism
    # These once ran: at negative positions, or removing a uid twice (a KeyError half-way through the plan).
    (StepPlan(1, new=(NewSequence(9, -4),), chunks=(Chunk(9, -4, (1, 2), LOGITS_LAST),),
              tables=(TableUpdate(9, (1,)),), num_blocks=2), "-4 cached positions"),
    (StepPlan(1, removed=(7, 7), num_blocks=1), "removes a uid twice"),
    (StepPlan(1, new=(NewSequence(9, 0), NewSequence(9, 0)), num_blocks=1), "adds a uid twice"),
    (StepPlan(1, chunks=(Chunk(7, 3, (9,), LOGITS_LAST), Chunk(7, 3, (9,), LOGITS_LAST)), num_blocks=1),
     "runs a uid twice"),
    (StepPlan(1, chunks=(Chunk(7, 3, (9,), 5),), num_blocks=1), "logits of an unknown kind"),
])
def test_plans_that_do_not_fit_are_refused_before_touching_arrays(path, plan, words):
    rank = make_rank(path)
    rank.step(first_plan())
    with pytest.raises(SplitBrain, match=words):
        rank.step(plan)


def test_ids_that_follow_a_plan_are_checked_and_give_the_same_logits(path):
    """A plan sent with `ids_follow` is applied first (`prepare`), then launched on the ids that followed it:
    the same logits as the plan holding them. Ids outside the vocabulary, or not one per chunk, are refused."""
    step = StepPlan(1, chunks=(Chunk(7, 3, (9,), LOGITS_LAST),), num_blocks=1, fingerprint=batch_fingerprint({7: 4}))
    ahead = dataclasses.replace(step, chunks=(Chunk(7, 3, (0,), LOGITS_LAST),), ids_follow=True)
    whole, follow = make_rank(path), make_rank(path)
    for rank in (whole, follow):
        rank.step(first_plan())
    want = whole.step(step).logits
    prepared = follow.prepare(ahead)
    for ids, words in (((VOCAB + 200,), "vocabulary"), ((-1,), "vocabulary"), ((9, 9), "2 ids for a plan of 1")):
        with pytest.raises(SplitBrain, match=words):
            follow.runner.follow_ids(ahead, ids)
    with pytest.raises(SplitBrain, match="whose ids were its own"):
        follow.runner.follow_ids(step, (9,))
    got = follow.launch(prepared, tokens=follow.runner.follow_ids(ahead, (9,))).logits
    assert mx.array_equal(got, want).item()


def test_a_rank_that_missed_a_step_is_detected(path):
    lagging = make_rank(path)  # never received step 0: holds no KV for uid 7
    with pytest.raises(SplitBrain, match="holds nothing"):
        lagging.step(StepPlan(1, chunks=(Chunk(7, 3, (9,), LOGITS_LAST),), num_blocks=1))


def test_local_executor_delegates_and_resets(path):
    ex = LocalExecutor(make_rank(path))
    assert ex.execute(first_plan()).uids == [7] and ex.kv_bytes() > 0
    assert ex.reset("boom") is None and ex.rank.runner.lengths == {}


# -- the operations the next capabilities need ----------------------------------------------------


def positions_logits(rank: RankState, step: int, uid: int, start: int, tokens, blocks_needed: int, logits=LOGITS_ALL,
                     new=False, trims=()) -> mx.array:
    table = (TableUpdate(uid, tuple(range(blocks_needed))),) if new else ()
    plan = StepPlan(step, new=(NewSequence(uid, 0),) if new else (), chunks=(Chunk(uid, start, tuple(tokens), logits),),
                    tables=table, trims=trims, num_blocks=blocks_needed)
    result = rank.step(plan)
    return result.logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [4, 9])
@pytest.mark.parametrize("split", [True, False], ids=["as-decode-rows", "extend"])
def test_a_chunk_gives_logits_for_every_position_and_equals_one_at_a_time(path, reference, monkeypatch,
                                                                           backend, n, split):
    """A few tokens after cached ones (a verify chunk) run as decode rows (batch.SPLIT_MAX_TOKENS) or,
    longer or with the split off, as one extend row: either way each row of logits is the model's."""
    monkeypatch.setattr(batch_module, "SPLIT_MAX_TOKENS", batch_module.SPLIT_MAX_TOKENS if split else 1)
    prompt = [11, 12, 13, 14, 15]
    tokens, rows = reference(prompt, n + 2)
    rank = make_rank(path, backend[0])
    positions_logits(rank, 0, 1, 0, prompt, 3, LOGITS_LAST, new=True)
    many = positions_logits(rank, 1, 1, 5, tokens[:n], 3)  # n tokens at once (across a block edge), a row each
    assert many.shape[0] == n
    for i in range(n):
        assert mx.abs(many[i] - rows[i + 1]).max().item() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_last_layer_runs_on_the_rows_with_logits_only_and_gives_the_same_logits(path, monkeypatch, backend):
    """After the last attention only the rows whose logits are wanted go on (model/forward.py): the logits
    equal the whole layer's, and the K and V of every position are still written (the next step reads them)."""
    narrowed = []
    real = forward_module.rows_after_attention
    monkeypatch.setattr(forward_module, "rows_after_attention",
                        lambda layer, h, kv, index: narrowed.append(index.size) or real(layer, h, kv, index))
    plans = [
        StepPlan(0, new=(NewSequence(1, 0), NewSequence(2, 0)),
                 chunks=(Chunk(1, 0, tuple(range(3, 20)), LOGITS_LAST),
                         Chunk(2, 0, tuple(range(30, 41)), LOGITS_NONE)),
                 tables=(TableUpdate(1, (0, 1, 2)), TableUpdate(2, (3, 4))), num_blocks=5),
        StepPlan(1, chunks=(Chunk(1, 17, (50,), LOGITS_LAST), Chunk(2, 11, tuple(range(60, 80)), LOGITS_LAST)),
                 tables=(TableUpdate(2, (5, 6)),), num_blocks=7),
        StepPlan(2, chunks=(Chunk(1, 18, (51, 52, 53), LOGITS_ALL), Chunk(2, 31, (54,), LOGITS_LAST)),
                 tables=(TableUpdate(2, (7,)),), num_blocks=8),
        StepPlan(3, chunks=(Chunk(1, 21, (55,), LOGITS_LAST), Chunk(2, 32, (56,), LOGITS_LAST)), num_blocks=8),
    ]
    runs = {}
    for narrow in (True, False):
        monkeypatch.setattr(forward_module, "FUSABLE_MODULES", decode_layer_module.FUSABLE_MODULES if narrow else ())
        rank = make_rank(path, backend[0])
        runs[narrow] = [rank.step(plan).logits for plan in plans]
    assert narrowed == [1, 2]  # the prefill plans only: a verify chunk or a step of decode rows wants every row
    for got, want in zip(runs[True], runs[False]):
        assert got.shape == want.shape
        assert mx.abs(got - want).max().item() < 1e-5
        assert mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item()


def test_short_continuing_rows_split_into_decode_rows_and_others_do_not():
    long = batch_module.SPLIT_MAX_TOKENS + 1  # one token more than a split takes
    rows = [RowSpec(1, 10, (5, 6, 7), tuple(range(4)), LOGITS_ALL), RowSpec(2, 0, (5, 6), (4,), LOGITS_LAST),
            RowSpec(3, 20, tuple(range(long)), tuple(range(11, 11 + (20 + long + BS - 1) // BS)), LOGITS_ALL),
            RowSpec(4, 3, (8,), (9,), LOGITS_LAST), RowSpec(5, 6, (1, 2), (10,), LOGITS_LAST)]
    b = Batch.build(rows, BS)
    assert b.decode.count == 3 + 1 + 2  # uid 1's three tokens, uid 4, uid 5's two
    assert b.decode.lengths.tolist() == [11, 12, 13, 4, 7, 8]
    assert b.logit_rows == [1, 1, 1, 4, 5, 2] + [3] * long  # LOGITS_LAST of uid 5: its last token


def test_short_rows_after_a_long_context_attend_as_one_row_but_the_shortest():
    """Each decode row reads its whole context: past a few tokens after thousands of positions, the paged
    causal kernel (one read of the context) is the cheaper (batch.SPLIT_MAX_PAIRS)."""
    blocks = tuple(range(8_200 // BS + 1))
    rows = [RowSpec(1, 8_000, tuple(range(9)), blocks, LOGITS_ALL), RowSpec(2, 8_000, (1, 2, 3, 4), blocks, LOGITS_ALL),
            RowSpec(3, 1_000, tuple(range(9)), blocks[:130], LOGITS_ALL)]
    b = Batch.build(rows, BS)
    assert b.decode.count == 4 + 9  # uid 2's four tokens and uid 3's nine; uid 1 stays a row of nine
    assert b.logit_rows == [2] * 4 + [3] * 9 + [1] * 9


def test_trim_rolls_a_row_back_and_the_next_tokens_see_only_what_was_kept(path, reference):
    prompt = [21, 22, 23, 24, 25, 26, 27]
    tokens, rows = reference(prompt, 6)
    rank = make_rank(path)
    positions_logits(rank, 0, 1, 0, prompt, 2, LOGITS_LAST, new=True)
    drafts = [tokens[0], tokens[1], 99, 98, 97]  # the last three are wrong guesses
    positions_logits(rank, 1, 1, 7, drafts, 2)
    assert rank.runner.seqs[1].length == 12
    # Keep the prompt and the two right tokens, then carry on from there.
    got = positions_logits(rank, 2, 1, 9, [tokens[2]], 2, LOGITS_LAST, trims=(Trim(1, 9, 2),))
    assert mx.abs(got[0] - rows[3]).max().item() < 1e-4


def test_a_layer_range_forward_equals_the_whole_models_hidden_state_at_that_layer(path):
    """A pipeline stage: token ids in, hidden states out after its layers; the next stage's hidden
    states in, logits out. Each allocates KV for its own layers only."""
    from meshlm.kv.store import KVShape, KVStore
    from meshlm.model.adapt import ModelParts
    from meshlm.model.batch import Batch, RowSpec
    from meshlm.model.forward import forward

    model, _ = mlx_lm.load(str(path))
    prompt = mx.array([[31, 32, 33, 34, 35, 36]])
    inner = model.model
    h = inner.embed_tokens(prompt)
    cache = make_prompt_cache(model)
    for layer, c in zip(inner.layers[:1], cache):
        h = layer(h, "causal", c)
    want_hidden = h
    want_logits = model(prompt)[0]

    rank = make_rank(path, "portable")
    first = ModelParts(rank.parts.embed, rank.parts.layers[:1], None, None, 0, 2)
    second = ModelParts(rank.parts.embed, rank.parts.layers[1:], rank.parts.norm, rank.parts.lm_head, 1, 2)
    for part in (first, second):
        assert len(part.layers) == 1
    shape = rank.store.shape
    stores = [KVStore(KVShape(1, shape.kv_heads, shape.head_dim, BS, shape.dtype), 4) for _ in range(2)]
    assert 2 * stores[0].shape.block_bytes == shape.block_bytes  # each stage: KV for its one layer
    batch = Batch.build([RowSpec(1, 0, tuple(prompt[0].tolist()), (0,), LOGITS_ALL)], BS)
    hidden = forward(first, batch, stores[0], rank.backend)
    assert mx.abs(hidden - want_hidden).max().item() < 1e-5
    logits = forward(second, batch, stores[1], rank.backend, hidden=hidden)
    assert mx.abs(logits - want_logits).max().item() < 1e-4


def test_a_saved_block_is_copied_before_the_plan_that_reuses_it_writes_it(path, tmp_path):
    """A committed block's save rides in the next plan; if its sequence ended, that plan may already hand
    the block to another sequence. The SSD copy must hold the committed KV, not the new owner's."""
    from meshlm.engine.plan import BlockSave

    cfg = ModelConfig(str(path))
    rank = build_rank(load_model(cfg), cfg, CacheConfig(ssd=True, cache_dir=str(tmp_path), block_size=BS), 2**24)
    positions_logits(rank, 0, 1, 0, list(range(20, 20 + BS)), 1, LOGITS_LAST, new=True)  # fills block 0
    want = rank.store.extract([0])[0]
    mx.eval(want.keys, want.values)
    key = b"k" * 16
    plan = StepPlan(1, new=(NewSequence(2, 0),), chunks=(Chunk(2, 0, tuple(range(100, 100 + BS)), LOGITS_LAST),),
                    removed=(1,), tables=(TableUpdate(2, (0,)),), saves=(BlockSave(0, key),), num_blocks=1)
    mx.eval(rank.step(plan).logits)
    rank.flush(timeout=10)
    got = rank.ssd.load(key)
    assert got is not None
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        assert mx.array_equal(a, b)


def test_a_partial_hit_may_lend_from_a_block_loaded_in_the_same_plan(path, tmp_path):
    """The scheduler makes a block loaded from SSD findable at once, so a later admission in the same
    plan can copy its first tokens: the load must land before the copy reads it."""
    from meshlm.engine.plan import BlockCopy, BlockLoad, BlockSave

    cfg = ModelConfig(str(path))
    rank = build_rank(load_model(cfg), cfg, CacheConfig(ssd=True, cache_dir=str(tmp_path), block_size=BS), 2**24)
    positions_logits(rank, 0, 1, 0, list(range(20, 20 + BS)), 1, LOGITS_LAST, new=True)  # block 0
    key = b"s" * 16
    rank.step(StepPlan(1, removed=(1,), saves=(BlockSave(0, key),), num_blocks=3))
    rank.flush(timeout=10)
    want = rank.ssd.load(key)
    rank.step(StepPlan(2, loads=(BlockLoad(key, 1),), copies=(BlockCopy(1, 2, BS // 2),), num_blocks=3))
    got = rank.store.extract([2])[0]
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        assert mx.array_equal(a[:, : BS // 2], b[:, : BS // 2])


def drive_ahead(rank: RankState, prompts: list[list[int]], max_tokens: int) -> tuple[dict[int, list[int]], int]:
    """The engine's asynchronous scheduling in miniature: each decode step is planned (`continue_ahead`)
    and launched on the previous step's argmax while it is still lazy, then the previous step is read.
    Returns each sequence's tokens and how many steps were planned ahead."""
    blocks = BlockManager(rank.max_blocks, rank.block_size, rank.salt, rank.ssd)
    sched = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=64), blocks, 4096)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens, temperature=0)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    plan, _ = sched.schedule()
    result = rank.step(plan)
    ahead_steps = 0
    while True:
        tokens = mx.argmax(result.logits, axis=-1) if result.logits is not None else None
        ahead = sched.continue_ahead(plan, result.uids) if tokens is not None else None
        if ahead is not None:
            row = {u: i for i, u in enumerate(result.uids)}
            following = rank.step(ahead, tokens=tokens[mx.array([row[c.uid] for c in ahead.chunks])])
            ahead_steps += 1
        sched.update(plan, {u: [t] for u, t in zip(result.uids, tokens.tolist())} if tokens is not None else {})
        if ahead is not None:
            plan, result = ahead, following
        elif sched.has_work:
            plan, _ = sched.schedule()
            result = rank.step(plan)
        else:
            return {s.uid: s.output_ids for s in seqs}, ahead_steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_planned_ahead_on_device_tokens_equal_each_sequence_alone(path, reference, backend):
    prompts = [[5, 9, 33, 71], list(range(40, 60)), [200, 3]]
    tokens, ahead = drive_ahead(make_rank(path, backend[0]), prompts, 12)
    assert ahead >= 9  # every decode step but the first after a prefill, and any after a block save
    for uid, p in enumerate(prompts):
        assert tokens[uid] == reference(p, 12)[0]


def test_a_step_planned_ahead_updates_the_pools_in_place(path):
    """A step launched while the previous one still reads the pools would make MLX copy every pool it
    writes (and page in a reserved pool whole): the runner waits for the previous step before launching."""
    rank = make_rank(path, "native", budget=2**30)
    store = rank.runner.store
    mx.eval(store.keys + store.values)
    reserved = mx.get_active_memory()
    one_pool = store.keys[0].nbytes
    assert one_pool >= 2**26
    mx.reset_peak_memory()
    # The long prompt's prefill still runs when the first step planned ahead is launched.
    drive_ahead(rank, [[5, 9, 33, 71], [(7 * i) % VOCAB for i in range(1500)]], 8)
    assert mx.get_peak_memory() - reserved < one_pool // 4
