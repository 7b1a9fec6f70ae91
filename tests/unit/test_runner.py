"""The runner on a tiny random llama: batched, chunked execution equals running each sequence alone.

The reference runs one sequence with mlx-lm's own per-sequence cache, so the
runner's left-padded batch caches (join by extend, leave by filter) are checked
against code that shares nothing with them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from meshlm.config import SchedulerConfig
from meshlm.engine.plan import Chunk, StepPlan, batch_fingerprint
from meshlm.engine.request import SamplingParams, Sequence
from meshlm.engine.scheduler import Scheduler
from meshlm.model import demo
from meshlm.model.runner import Runner, SplitBrain
from meshlm.parallel.local import LocalExecutor

VOCAB = 400  # ids the tiny model knows (its tokenizer has ~500)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = demo.make_tiny(tmp_path_factory.mktemp("tiny"), model_type="llama", seed=0)
    model, _ = mlx_lm.load(str(path))
    return model


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens and per-token logits of one sequence run alone (memoised)."""
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
    """Four short prompts at step 0 (prefilled together in one padded forward), then
    long prompts (prefilled in chunks) and short ones arriving while others decode."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 4) if i < 4 or i % 2 else rng.randint(18, 48) for i in range(n)]
    return Workload(
        prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
        max_tokens=[rng.randint(3, 10) for _ in range(n)],
        arrival=[0] * 4 + sorted(rng.randint(1, 8) for _ in range(n - 4)),
    )


@dataclass
class Run:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, list[mx.array]] = field(default_factory=dict)
    kv_bytes: list[int] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    decode_batch_sizes: list[int] = field(default_factory=list)
    preemptions: int = 0
    runner: Runner | None = None


def drive(model, w: Workload, *, step_tokens=16, batch=16, kv_budget=100_000, aborts=None) -> Run:
    """The engine loop in miniature: schedule, execute, greedy-sample, update."""
    aborts = aborts or {}
    sched = Scheduler(SchedulerConfig(max_batch_size=batch, max_tokens_per_step=step_tokens), kv_budget,
                      min(kv_budget, 4096))
    runner = Runner(model)
    out = Run(runner=runner)
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
        out.decode_batch_sizes.append(len(runner.decode_uids))
        result = runner.execute(plan)
        assert sorted(result.uids) == sorted(c.uid for c in plan.chunks if c.sample)
        sampled = {}
        if result.logits is not None:
            mx.eval(result.logits)
            assert result.logits.shape == (len(result.uids), model.lm_head.weight.shape[0])
            sampled = dict(zip(result.uids, mx.argmax(result.logits, axis=-1).tolist()))
            for i, uid in enumerate(result.uids):
                out.logits.setdefault(uid, []).append(result.logits[i])
        sched.update(plan, sampled)
        out.plans.append(plan)
        out.kv_bytes.append(runner.kv_bytes)
        t += 1
        assert t < 500
    out.tokens = {s.uid: s.output_ids for s in seqs}
    out.preemptions = sched.num_preemptions
    return out


@pytest.fixture(scope="module")
def workload():
    return make_workload()


@pytest.fixture(scope="module")
def batched(model, workload):
    return drive(model, workload)


def test_workload_exercises_every_runner_path(batched):
    plans = batched.plans
    assert any(not c.sample for p in plans for c in p.chunks)  # chunked prefill
    assert any(sum(c.start == 0 and c.sample for c in p.chunks) > 1 for p in plans)  # padded batch prefill
    assert any(p.new and batched.decode_batch_sizes[i] for i, p in enumerate(plans))  # join while decoding
    assert any(p.removed and p.chunks for p in plans)  # leave while others go on
    assert max(batched.decode_batch_sizes) >= 4


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


def test_kv_is_freed_when_every_sequence_has_left(batched):
    assert max(batched.kv_bytes) > 0
    assert batched.kv_bytes[-1] == 0
    runner = batched.runner
    assert runner.decode_cache is None and not runner.prefill_caches and not runner.lengths


def test_abort_mid_run_leaves_other_sequences_unchanged(model, workload, reference):
    # uids 4 and 8 are long prompts: abort them mid-prefill (their own chunk cache);
    # uid 1 is a short one: abort it from the middle of the shared decode batch.
    aborts = {2: [4], 3: [1], 9: [8]}
    run = drive(model, workload, aborts=aborts)
    assert [u for p in run.plans for u in p.removed if u in (1, 4, 8)] == [4, 1, 8]
    for uid, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        full = reference(prompt, n)[0]
        if uid in (1, 4, 8):
            assert len(run.tokens[uid]) < n and full[: len(run.tokens[uid])] == run.tokens[uid]
        else:
            assert run.tokens[uid] == full, uid
    assert run.tokens[4] == run.tokens[8] == []  # aborted before their prompts were done
    assert run.kv_bytes[-1] == 0


def test_preemption_and_recompute_give_the_same_tokens(model, reference):
    rng = random.Random(0)
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(6)],
                 max_tokens=[20] * 6, arrival=[0, 0, 0, 1, 1, 2])
    run = drive(model, w, step_tokens=16, batch=6, kv_budget=48)  # six 28-40 token sequences
    assert run.preemptions >= 3
    # Some recompute re-ran generated tokens, not just the prompt.
    assert any(c.start == 0 and len(c.token_ids) > len(w.prompts[c.uid]) for p in run.plans for c in p.chunks)
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        assert run.tokens[uid] == reference(prompt, n)[0], uid
    assert run.kv_bytes[-1] == 0


def test_sequences_crossing_the_cache_allocation_step(model, reference):
    # KV caches grow in 256-token steps; rows join, leave and get padded across that boundary.
    rng = random.Random(3)
    lengths = [250, 5, 240, 300, 1, 270]
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
                 max_tokens=[12, 20, 30, 8, 15, 10], arrival=[0, 3, 4, 6, 9, 12])
    run = drive(model, w, step_tokens=64, batch=8)
    for uid, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        assert run.tokens[uid] == reference(prompt, n)[0], uid


@pytest.mark.xfail(
    strict=True,
    reason="bug: the scheduler bounds the sum of per-sequence KV tokens (scheduler.py:69-70), but the "
    "runner's shared BatchKVCache left-pads every decode row to the longest row (runner.py:118-126), so "
    "real KV memory is ~rows x longest: 13.7x the budget here, not bounded by kv_cache_memory",
)
def test_kv_memory_stays_within_the_token_budget(model):
    rng = random.Random(0)
    lengths = [600] + [2] * 15  # one long conversation, fifteen short ones
    w = Workload(prompts=[[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths],
                 max_tokens=[20] * 16, arrival=[0] + [1] * 15)
    budget = 1_000
    run = drive(model, w, step_tokens=700, batch=16, kv_budget=budget)
    per_token = Runner(model).kv_bytes_per_token()
    slack = 256 * 16  # caches allocate in 256-token steps per row
    assert max(run.kv_bytes) <= per_token * (budget + slack)


def test_fingerprint_mismatch_raises_split_brain(model):
    step0 = StepPlan(0, chunks=(Chunk(7, 0, (5, 6, 7), sample=True),), fingerprint=batch_fingerprint({7: 3}))
    assert Runner(model).execute(step0).uids == [7]  # consistent: no error
    # The leader believes uid 7 holds 5 tokens after this step, or that uid 8 exists too.
    for lengths in ({7: 5}, {7: 4, 8: 1}):
        plan = StepPlan(1, chunks=(Chunk(7, 3, (9,), sample=True),), fingerprint=batch_fingerprint(lengths))
        with pytest.raises(SplitBrain, match="step 1"):
            runner_after(model, step0).execute(plan)


def runner_after(model, *plans: StepPlan) -> Runner:
    runner = Runner(model)
    for plan in plans:
        runner.execute(plan)
    return runner


def test_rank_that_missed_a_step_is_detected(model):
    step0 = StepPlan(0, chunks=(Chunk(7, 0, (5, 6, 7), sample=True),), fingerprint=batch_fingerprint({7: 3}))
    step1 = StepPlan(1, chunks=(Chunk(7, 3, (9,), sample=True),), fingerprint=batch_fingerprint({7: 4}))
    runner_after(model, step0, step1)  # the leader: fine
    lagging = Runner(model)  # never received step 0: holds no KV for uid 7
    with pytest.raises(SplitBrain):
        lagging.execute(step1)  # actual: runs token 9 at position 0 as if it were position 3


def test_decode_row_without_a_token_raises_split_brain(model):
    runner = Runner(model)
    runner.execute(StepPlan(0, chunks=(Chunk(1, 0, (5, 6), sample=True), Chunk(2, 0, (7,), sample=True))))
    assert runner.decode_uids == [1, 2]
    with pytest.raises(SplitBrain, match=r"\[2\]"):
        runner.execute(StepPlan(1, chunks=(Chunk(1, 2, (9,), sample=True),)))


def test_local_executor_delegates_and_resets(model):
    ex = LocalExecutor(model)
    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    # keys + values, every layer, float32
    assert ex.kv_bytes_per_token() == 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * 4
    result = ex.execute(StepPlan(0, chunks=(Chunk(1, 0, (5, 6, 7), sample=True),)))
    assert result.uids == [1] and ex.kv_bytes() > 0
    assert ex.reset("boom") is None and ex.kv_bytes() == 0 and ex.runner.lengths == {}


def test_cpu_kernels_give_the_same_tokens_and_logits(model, workload, reference, monkeypatch):
    """The whole batched path (padded prefill, chunks, joins, leaves, a decode batch split over two
    CPU streams) with meshlm's CPU kernels, against stock mlx-lm run one sequence at a time."""
    import sys

    from meshlm.model import cpu_kernels

    want = {uid: reference(p, n) for uid, (p, n) in enumerate(zip(workload.prompts, workload.max_tokens))}
    module = sys.modules[type(model).__module__]
    for name in ("scaled_dot_product_attention", "swiglu"):  # restored at teardown
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(cpu_kernels, "SPLIT_DECODE_ROWS", 2)
    assert cpu_kernels.install(model, cores=2)
    run = drive(model, workload)
    assert max(run.decode_batch_sizes) >= 2
    for uid, (tokens, rows) in want.items():
        assert run.tokens[uid] == tokens, uid
        assert max(mx.abs(got - ref).max().item() for got, ref in zip(run.logits[uid], rows)) < 1e-4
