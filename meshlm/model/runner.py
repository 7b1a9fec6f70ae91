"""The runner: applies a StepPlan to this rank's KV store and runs its forward.

Per sequence a rank knows only its block table and how many positions it
holds; the leader's block manager decided both, so every rank's tables are the
same. A step is: copies of the blocks to save, handed to the SSD writer (taken
first: a committed block whose sequence ended may be reused by this very
plan), the plan's table changes and trims, SSD loads and then block copies
(partial prefix hits, which may lend from a block loaded in the same plan)
into the pools (a block this rank cannot read is reported in the result, not
raised: the leader recomputes the sequences that read it), then one forward
over the flattened batch (decode and prefill rows together).

Every value of a plan is checked before it touches an array, so a plan that
does not fit this rank's state (a missed step, a bad block id) is a clear
`SplitBrain`, never a stray memory access: MLX's gathers do not check bounds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx

from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Chunk, StepPlan, batch_fingerprint
from meshlm.step_times import StepTimes
from meshlm.kv.store import BlockData, KVStore
from meshlm.model.adapt import ModelParts
from meshlm.model.attention import AttentionBackend
from meshlm.model.batch import Batch, RowSpec
from meshlm.model.context_batch import ContextBatch, choose_algorithm
from meshlm.model.forward import forward
from meshlm.model.ring_attention import RingContext, forward_ring

log = logging.getLogger(__name__)


class SplitBrain(RuntimeError):
    """This rank's state no longer matches the plan (or the plan is not a valid one)."""


@dataclass
class SeqKV:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions whose KV this rank holds
    holder: int = -1  # context parallelism: the rank holding the whole sequence (-1: split over every rank)


@dataclass
class Prepared:
    """A step applied to the tables (`Runner.prepare`), its forward not yet built."""

    plan: StepPlan
    rows: list[RowSpec]  # one per chunk
    seconds: float  # host time preparing took
    waited: float  # of it before: waiting for the previous step's forward
    missing: tuple[bytes, ...] = ()  # keys of blocks the plan loads that this rank could not read


@dataclass
class StepResult:
    uids: list[int]  # the sequence of each row of `logits`, in order
    logits: mx.array | None  # (len(uids), vocab) float32, evaluating asynchronously
    launch_seconds: float = 0.0  # host time spent building and launching the step
    hidden: mx.array | None = None  # a pipeline stage's output instead of logits
    # Keys of blocks the plan loads that this rank could not read: the rows reading them are garbage here,
    # and the leader recomputes their sequences (engine `_check_loads`).
    missing: tuple[bytes, ...] = ()


class KVExporter(Protocol):
    """Where a prefill server's rank hands the blocks a plan exports (disaggregated prefill)."""

    def deliver(self, uid: int, index: int, data: BlockData) -> None: ...


class BlockSource(Protocol):
    """A tier of blocks a plan may load by key (the SSD tier; blocks received from a prefill server)."""

    def load(self, key: bytes) -> BlockData | None: ...


class Runner:
    def __init__(self, parts: ModelParts, store: KVStore, backend: AttentionBackend, ssd=None,
                 vocab_size: int | None = None, ring: RingContext | None = None,
                 received: BlockSource | None = None, exporter: KVExporter | None = None,
                 times: StepTimes | None = None) -> None:
        self.parts = parts
        self.store = store
        self.backend = backend
        self.ssd = ssd  # this rank's SSD tier, or None
        self.received = received  # blocks a prefill server sent, looked up before the SSD tier
        self.exporter = exporter
        self.vocab_size = vocab_size
        self.ring = ring  # context parallelism: this rank holds its share of every block's positions
        # Positions per block id in the plans: a context-parallel rank's pool holds its share of each.
        self.block_size = ring.split.logical_block if ring is not None else store.block_size
        self.seqs: dict[int, SeqKV] = {}
        self._pending: list[mx.array] = []  # what the last step launched
        self.times = times if times is not None else StepTimes()

    @property
    def lengths(self) -> dict[int, int]:
        """Positions in KV per sequence: what the batch fingerprint is computed over."""
        return {uid: s.length for uid, s in self.seqs.items()}

    @property
    def kv_bytes(self) -> int:
        return self.store.nbytes

    # -- a step -------------------------------------------------------------
    def execute(self, plan: StepPlan, hidden: mx.array | None = None, tokens: mx.array | None = None,
                on_ids: Callable[[list[int]], None] | None = None) -> StepResult:
        """Apply `plan` and launch its forward. `tokens`: the input ids of a plan of decode rows planned ahead
        (`Scheduler.continue_ahead`), one per chunk in order, still being sampled by the previous step; the
        chunks' own ids are placeholders then. `on_ids`: told them once sampled, before the forward that
        takes them is launched (other ranks need them to join it)."""
        return self.launch(self.prepare(plan, ahead=tokens is not None), hidden, tokens, on_ids)

    def prepare(self, plan: StepPlan, ahead: bool = False) -> Prepared:
        """The part of a step that needs only its plan: checks, saves, table changes, loads and copies, each
        row's positions. A pipeline stage after the first does this while the activation is on its way
        (executor/pipeline.py); `launch` runs the rest. `ahead`: a step planned ahead, built while the previous
        one still runs (it waits for it only before launching)."""
        t0 = time.perf_counter()
        waited = 0.0 if ahead else self._finish_previous()
        self._check(plan)
        self._save(plan)
        self._export(plan)
        self._apply_tables(plan)
        self.store.ensure(plan.num_blocks)
        # Loads first: a partial prefix hit may lend from a block this same plan loads from SSD.
        read = [(x, self._read(x.key)) for x in plan.loads]
        found = [(x.block, data) for x, data in read if data is not None]
        self.store.load([block for block, _ in found], [data for _, data in found])
        for c in plan.copies:
            self.store.copy(c.src, c.dst, self._local(c.tokens))
        rows = [self._row(c) for c in plan.chunks]
        missing = tuple(x.key for x, data in read if data is None)
        return Prepared(plan, rows, time.perf_counter() - t0 - waited, waited, missing)

    def launch(self, prepared: Prepared, hidden: mx.array | None = None, tokens: mx.array | None = None,
               on_ids: Callable[[list[int]], None] | None = None) -> StepResult:
        """Build and launch the forward of a prepared step (`execute` is both at once)."""
        plan, rows, waited = prepared.plan, prepared.rows, prepared.waited
        # Host seconds of this step so far, as if prepare had run just now: the link wait between is not its own.
        t0 = time.perf_counter() - prepared.seconds - waited
        out = None
        batch = None
        result = None  # set here by a context-parallel step
        collective = None  # a context-parallel rank's share of the step's last collectives
        if rows and self.ring is not None:
            if tokens is not None:
                raise SplitBrain(f"step {plan.step_id}: a context-parallel step takes no tokens planned ahead")
            result, collective = self._ring_step(rows, t0)
        elif rows:
            batch = Batch.build(rows, self.store.block_size, self.backend.groups_extend_rows)
            if tokens is not None:
                batch = self._with_tokens(batch, tokens, plan)
            out = forward(self.parts, batch, self.store, self.backend, hidden)
        for c in plan.chunks:
            self.seqs[c.uid].length = c.start + len(c.token_ids)
        if plan.fingerprint and batch_fingerprint(self.lengths) != plan.fingerprint:
            raise SplitBrain(f"step {plan.step_id}: batch fingerprint mismatch")
        if result is None:
            result = self._result(out, batch, t0)
        result.missing = prepared.missing
        if tokens is not None:
            waited += self._finish_previous()
            if on_ids is not None:
                # Before the launch, which on the CPU returns only near the forward's end (below): the
                # forward's first sum would wait for ranks that wait for these ids.
                on_ids(tokens.tolist())
        self._pending = self.store.keys + self.store.values
        self._pending += [x for x in (result.logits, result.hidden, collective) if x is not None]
        launched = time.perf_counter()
        self.times.add("build", launched - t0 - waited)
        # MLX's CPU stream lets only ~100 ops be queued ahead of the thread launching them, so this
        # returns near the forward's end: the time is the device's, not the graph's.
        mx.async_eval(self._pending)
        self.times.add("device", time.perf_counter() - launched)
        return result

    def _finish_previous(self) -> float:
        """Wait for the previous step before this one is launched; returns the seconds waited. Its readers
        of the pools must be done before this step's writes are launched (MLX decides then whether a write
        may update the pool in place: were a reader pending, it would copy the whole pool, which also makes
        every reserved page resident), and nothing here may hold the pools once written (a ring step
        evaluates its large attention blocks mid-forward, while this list would still be alive)."""
        t0 = time.perf_counter()
        mx.eval(self._pending)
        self._pending = []
        waited = time.perf_counter() - t0
        self.times.add("device", waited)
        return waited

    def follow_ids(self, plan: StepPlan, ids: tuple[int, ...]) -> mx.array:
        """The input ids a TOKENS frame carried for `plan` (sent with `ids_follow`), checked as a plan's own
        ids are, as `launch`'s `tokens`."""
        if not plan.ids_follow or len(ids) != len(plan.chunks):
            raise SplitBrain(f"step {plan.step_id}: {len(ids)} ids for a plan of {len(plan.chunks)} chunks"
                             + ("" if plan.ids_follow else " whose ids were its own"))
        self._check_vocab(f"step {plan.step_id}", ids)
        return mx.array(ids, dtype=mx.int32)

    def _with_tokens(self, batch: Batch, tokens: mx.array, plan: StepPlan) -> Batch:
        if tokens.shape != (len(plan.chunks),) or any(len(c.token_ids) != 1 for c in plan.chunks):
            raise SplitBrain(f"step {plan.step_id}: {tokens.shape} device tokens for a plan of "
                             f"{plan.num_tokens} tokens in {len(plan.chunks)} chunks")
        return dataclasses.replace(batch, tokens=tokens.astype(mx.int32))

    def _ring_step(self, rows: list[RowSpec], t0: float) -> tuple[StepResult, mx.array]:
        ring = self.ring
        algorithm = choose_algorithm(ring.algorithm, rows, ring.kv_heads, ring.q_heads, ring.min_new_for_kv)
        batch = ContextBatch.build(rows, ring.split, algorithm)
        logits, collective = forward_ring(self.parts, batch, self.store, ring.group, self.backend, ring.comm())
        if logits is None:
            return StepResult([], None, time.perf_counter() - t0), collective
        return StepResult(batch.logit_rows, logits.astype(mx.float32), time.perf_counter() - t0), collective

    def _local(self, positions: int) -> int:
        """Of a block's first `positions` positions, how many this rank's pool holds."""
        return self.ring.split.local_count(positions) if self.ring is not None else positions

    def _result(self, out: mx.array | None, batch: Batch | None, t0: float) -> StepResult:
        if out is None:
            return StepResult([], None, time.perf_counter() - t0)
        if not self.parts.computes_logits:
            return StepResult([], None, time.perf_counter() - t0, hidden=out)
        if not batch.logit_rows:  # prefill chunks only: their KV is the result
            return StepResult([], None, time.perf_counter() - t0)
        return StepResult(batch.logit_rows, out.astype(mx.float32), time.perf_counter() - t0)

    def _save(self, plan: StepPlan) -> None:
        """Copy the blocks the plan saves and hand them to the SSD writer. A block's content is final once
        committed, but its sequence may have ended and the block been handed to another sequence by this
        very plan, so the copies are taken (and evaluated) before anything here writes the pools."""
        if self.ssd is None:
            return
        for key in plan.touches:
            self.ssd.touch(key)
        if not plan.saves:
            return
        for s, block in zip(plan.saves, self._copies([s.block for s in plan.saves], host=True)):
            self.ssd.save(s.key, block)

    def _export(self, plan: StepPlan) -> None:
        """Copy the blocks the plan exports and hand them to the exporter; taken before anything writes
        the pools, for the reason `_save` gives."""
        if self.exporter is None or not plan.exports:
            return
        for x, data in zip(plan.exports, self._copies([x.block for x in plan.exports])):
            self.exporter.deliver(x.uid, x.index, data)

    def _copies(self, blocks: list[int], host: bool = False) -> list[BlockData]:
        """Evaluated copies of these blocks, as they are now (`host`: numpy where the dtype allows, which
        the SSD writer takes)."""
        copies = self.store.extract(blocks, host=host)
        mx.eval([a for c in copies for a in (*c.keys, *c.values) if isinstance(a, mx.array)])
        return copies

    # -- applying a plan ----------------------------------------------------
    def _check(self, plan: StepPlan) -> None:
        """Everything the plan names must exist (or not yet exist) and fit, before anything changes."""
        step = f"step {plan.step_id}"
        if not 0 <= plan.num_blocks <= self.store.max_blocks:
            raise SplitBrain(f"{step}: {plan.num_blocks} KV blocks, this rank's budget holds {self.store.max_blocks}")
        removed = set(plan.removed)
        for uid in removed:
            if uid not in self.seqs:
                raise SplitBrain(f"{step}: removes uid {uid}, which this rank does not hold")
        # Named twice, a uid would be removed twice (a KeyError half-way through) or run twice at the same
        # positions; a negative cached length would run at negative positions (RoPE, KV slots) unchecked.
        for what, uids in (("removes", plan.removed), ("adds", [n.uid for n in plan.new]),
                           ("runs", [c.uid for c in plan.chunks])):
            if len(set(uids)) != len(uids):
                raise SplitBrain(f"{step}: {what} a uid twice")
        ranks = self.ring.split.ranks if self.ring is not None else 0
        for n in plan.new:
            if n.uid in self.seqs and n.uid not in removed:
                raise SplitBrain(f"{step}: uid {n.uid} is new but this rank already holds it")
            if n.cached_len < 0:
                raise SplitBrain(f"{step}: uid {n.uid} is new with {n.cached_len} cached positions")
            if n.holder != -1 and not 0 <= n.holder < ranks:
                raise SplitBrain(f"{step}: uid {n.uid} is to be held whole by rank {n.holder}, "
                                 f"outside this layout's {ranks} context-parallel ranks")
        ids = [b for t in plan.tables for b in t.blocks] + [b for c in plan.copies for b in (c.src, c.dst)]
        ids += [x.block for x in plan.loads] + [x.block for x in plan.saves] + [x.block for x in plan.exports]
        if ids and not (0 <= min(ids) and max(ids) < plan.num_blocks):
            raise SplitBrain(f"{step}: a block id outside 0..{plan.num_blocks - 1}")
        if any(not 0 <= c.tokens <= self.block_size for c in plan.copies):
            raise SplitBrain(f"{step}: a block copy of more tokens than a block holds")
        if any(c.logits not in (LOGITS_NONE, LOGITS_LAST, LOGITS_ALL) for c in plan.chunks):
            raise SplitBrain(f"{step}: a chunk asks for logits of an unknown kind")
        self._check_vocab(step, [t for c in plan.chunks for t in c.token_ids])

    def _check_vocab(self, step: str, ids) -> None:
        """Token ids a plan or a TOKENS frame carries must index the embedding (MLX's gathers do not check)."""
        if ids and self.vocab_size is not None and not (0 <= min(ids) and max(ids) < self.vocab_size):
            raise SplitBrain(f"{step}: a token id outside the vocabulary")

    def _apply_tables(self, plan: StepPlan) -> None:
        for uid in plan.removed:
            del self.seqs[uid]
        for n in plan.new:
            self.seqs[n.uid] = SeqKV(length=n.cached_len, holder=n.holder)
        for t in plan.trims:
            seq = self._seq(t.uid, plan)
            if not 0 <= t.length <= seq.length or not 0 <= t.blocks <= len(seq.blocks):
                raise SplitBrain(f"step {plan.step_id}: trim of uid {t.uid} to {t.length} tokens does not fit")
            seq.length, seq.blocks = t.length, seq.blocks[: t.blocks]
        for t in plan.tables:
            self._seq(t.uid, plan).blocks.extend(t.blocks)

    def _seq(self, uid: int, plan: StepPlan) -> SeqKV:
        seq = self.seqs.get(uid)
        if seq is None:
            raise SplitBrain(f"step {plan.step_id}: uid {uid} is not held by this rank")
        return seq

    def _row(self, c: Chunk) -> RowSpec:
        seq = self.seqs.get(c.uid)
        if seq is None or c.start != seq.length:
            held = "nothing" if seq is None else f"{seq.length} positions"
            raise SplitBrain(f"uid {c.uid}: chunk starts at {c.start}, this rank holds {held}")
        end = c.start + len(c.token_ids)
        block_size = self.block_size if seq.holder < 0 else self.ring.split.block_size  # whole: b per id
        if not c.token_ids or -(-end // block_size) > len(seq.blocks):
            raise SplitBrain(f"uid {c.uid}: {end} positions, its table covers {len(seq.blocks)} blocks")
        return RowSpec(c.uid, c.start, c.token_ids, tuple(seq.blocks), c.logits, holder=seq.holder)

    def _read(self, key: bytes) -> BlockData | None:
        """A block the plan loads, or None: the leader listed it, but this rank's copy is gone or bad (each
        rank's SSD tier evicts, expires and fails on its own). The step goes on without it, every rank in
        lockstep; the leader learns of it from the step's result or ACK and recomputes what read it."""
        data = self.received.load(key) if self.received is not None else None
        from_disk = data is None and self.ssd is not None
        if from_disk:
            data = self.ssd.load(key)
        if data is None:
            log.warning("prefix block %s is not cached on this rank: the leader recomputes it", key.hex())
            return None
        problem = self.store.check_block(data)
        if problem is not None:
            log.warning("prefix block %s on this rank holds %s: dropped, the leader recomputes it", key.hex(), problem)
            if from_disk:  # else a received block, which the load took out already
                self.ssd.forget(key)  # or every later plan loading it would find it bad again
            return None
        if not from_disk and self.ssd is not None:
            # A received block is written through as one computed here is (blocks.commit): else the chain
            # of a handed-off prompt was on no disk, and after a restart, or once evicted, neither it nor
            # the blocks computed after it here (their chain starts with it) were found again.
            mx.eval(data.keys, data.values)  # on this thread: the writer's must not evaluate MLX ops
            self.ssd.save(key, data)
        return data
