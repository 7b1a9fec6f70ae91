"""The scheduler: decides each step by token accounting, and budgets KV in blocks.

Every sequence wants `num_tokens - num_computed_tokens` more tokens run. Each
step the scheduler hands out a token budget: one token to every decoding
sequence first (so running streams never stall behind a long prompt), then
prefill chunks to sequences still reading their prompt, then admits waiting
sequences while batch size and KV blocks allow. A prompt chunk against a long
context is also held to the step's work (engine/step_work.py), so that no
step grows with the context it attends to. Blocks come from the block
manager (kv/blocks.py), so `--kv-cache-memory` is exact: a sequence holds
ceil(positions / block_size) blocks, cached prefixes are shared, and nothing
is padded. When blocks run out the most recently admitted sequence is
preempted and later recomputed (its committed blocks stay cached, so the
recompute is mostly a prefix hit).

It never touches arrays: it sees uids, lengths, token ids and block ids only.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field

from meshlm.config import SchedulerConfig
from meshlm.engine.plan import (LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, BlockCopy, BlockExport, BlockLoad, BlockSave,
                                Chunk, NewSequence, StepPlan, TableUpdate, Trim, batch_fingerprint)
from meshlm.engine.request import FinishReason, Sequence, SeqStatus
from meshlm.engine.step_work import MIN_CHUNK, StepWork
from meshlm.kv.blocks import BlockManager


# A chunk scoring a prompt returns every position's logits (rows x vocab float32): at most this many rows
# a step, or a 1,024-token chunk of a 150K-token vocabulary would hold 0.6 GB of them.
SCORING_ROWS = 256


class QueueFull(Exception):
    """The bounded waiting queue is full; the caller should retry later."""


@dataclass(frozen=True)
class Finished:
    seq: Sequence
    reason: FinishReason
    error: str | None = None  # what the client is told when reason is ERROR
    request_fault: str = ""  # the error's code when it is the request's own (a 400), not the server's


@dataclass
class _Draft:
    """The plan being built this step."""

    chunks: list[Chunk] = field(default_factory=list)
    new: list[NewSequence] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    copies: list[BlockCopy] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    work: float = math.inf  # the step's work left (engine/step_work.py)
    prompt_chunks: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), work: StepWork | None = None) -> None:
        """`work`: what tokens cost against their context, so a long context's prompt chunks are shortened
        to keep a step's work bounded (None: the token budget alone)."""
        self.config = config
        self.work = work
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._to_remove: list[int] = []  # uids whose KV ranks must drop next step
        self._saves: list[BlockSave] = []  # committed blocks to write through, in the next plan
        self._trims: dict[int, Trim] = {}  # rejected drafts' positions every rank drops, in the next plan
        # uid -> (step id, positions held once that plan ran) per plan in flight, oldest first: two when the
        # next step was planned ahead (`continue_ahead`)
        self._in_flight: dict[int, list[tuple[int, int]]] = {}
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    # -- intake -----------------------------------------------------------
    def add(self, seq: Sequence, reserved: bool = False) -> None:
        """`reserved`: the sequence held a place in the queue already (a prefill handoff)."""
        if not reserved and len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(seq)

    def abort(self, uid: int) -> None:
        """Mark a sequence cancelled; it leaves the batch (and frees KV) at the next step."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.uid == uid and not seq.finished:
                seq.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._to_remove or self._saves or self._trims)

    # -- the step ---------------------------------------------------------
    def schedule(self, drafts: dict[int, tuple[int, ...]] | None = None, busy: frozenset[int] = frozenset(),
                 max_rows: int | None = None, max_tokens: int | None = None) -> tuple[StepPlan, list[Finished]]:
        """Plan one step. `drafts`: speculative tokens per decoding uid, verified in this step's forward
        when budget and KV allow (else the sequence decodes plainly). `busy`: sequences in a plan still in
        flight (a pipeline's other micro-batches), which wait for its results; `max_rows`: at most this
        many sequences in the plan, so a pipeline's micro-batches stay even; `max_tokens`: a lower token
        budget than --max-tokens-per-step for this plan. Returns the plan and sequences that ended
        without running (aborts)."""
        exports = self._exports()  # before the reap: a sequence that just finished still holds its blocks
        ended = self._reap()
        drafts = drafts or {}
        draft = _Draft()
        budget = self.config.max_tokens_per_step
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        rows = max_rows if max_rows is not None else self.config.max_batch_size
        plan_budget = budget
        if self.work is not None:
            # Decode rows first, whatever their place in the batch: a prompt's chunk takes what they leave
            draft.work = self.work.limit(budget) - sum(
                self.work.cost(seq.num_computed_tokens, 1) for seq in self.running
                if seq.uid not in busy and seq.num_tokens - seq.num_computed_tokens == 1)
        # Decode and continuing prefill for running sequences, oldest first;
        # only newer sequences are preempted, so the oldest always progresses.
        for seq in list(self.running):
            if budget == 0 or len(draft.chunks) >= rows:
                break
            if seq not in self.running:  # preempted by an older sequence's allocation this step
                continue
            if seq.uid not in busy:
                budget -= self._continue(seq, seq.num_computed_tokens, budget, draft, drafts.get(seq.uid, ()))
            elif (start := self._prompt_read_ahead(seq, whole=plan_budget)) is not None:
                budget -= self._continue(seq, start, budget, draft)
        self._admit(draft, budget, rows)
        rewrites, touches = self.blocks.take_refreshes()
        self._saves.extend(BlockSave(block, key) for block, key in rewrites)
        plan = StepPlan(
            step_id=next(self._step_ids),
            new=tuple(draft.new),
            chunks=tuple(draft.chunks),
            removed=tuple(self._to_remove),
            tables=tuple(TableUpdate(uid, tuple(b)) for uid, b in draft.tables.items() if b),
            trims=tuple(self._trims.values()),
            copies=tuple(draft.copies),
            loads=tuple(draft.loads),
            saves=tuple(self._saves),
            exports=exports,
            touches=tuple(touches),
            num_blocks=self.blocks.high_water,
            fingerprint=batch_fingerprint(self._lengths_after(draft.chunks)),
        )
        self._to_remove, self._saves, self._trims = [], [], {}
        self._launched(plan)
        self.blocks.end_step()
        return plan, ended

    def _launched(self, plan: StepPlan) -> None:
        for c in plan.chunks:
            self._in_flight.setdefault(c.uid, []).append((plan.step_id, c.start + len(c.token_ids)))

    def continue_ahead(self, plan: StepPlan, uids: list[int]) -> StepPlan | None:
        """Plan the step after `plan` while `plan` still runs, before its tokens are known (asynchronous
        scheduling, engine.py): each sequence of `uids` decodes the token `plan` samples for it, which the
        executor takes from the device. A sequence whose sampled token surely ends it (max_tokens, the
        model's length) sits the step out. None when the next step needs `schedule`: a sequence to admit,
        reap, roll back or export, blocks to save, a prompt still being read, a sequence not in `plan`,
        or too few free blocks (nothing is preempted here). Its chunks hold the placeholder token 0 until
        the caller knows the real ones; `update` reads only their lengths."""
        if self._to_remove or self._saves or self._trims or len(uids) > self.config.max_tokens_per_step:
            return None
        if self.waiting and len(self.running) < self.config.max_batch_size:
            return None  # room to admit: the next step is a full one
        chunks = {c.uid: c for c in plan.chunks}
        by_uid: dict[int, Sequence] = {}
        for seq in self.running:
            c = chunks.get(seq.uid)
            if (c is None or seq.finished or seq.aborted or seq.export_from is not None or c.logits != LOGITS_LAST
                    or self._in_flight.get(seq.uid) != [(plan.step_id, seq.num_tokens)]):
                return None
            by_uid[seq.uid] = seq
        if sorted(uids) != sorted(by_uid):
            return None
        rows = [by_uid[u] for u in uids if not self._length_reached(by_uid[u], ahead=1)]
        need = sum(max(0, self.blocks.blocks_for(s.num_tokens + 1) - len(self.blocks.table(s.uid))) for s in rows)
        if not rows or need > self.blocks.num_free:
            return None
        tables = {seq.uid: self.blocks.allocate(seq.uid, seq.num_tokens + 1) for seq in rows}
        ahead = tuple(Chunk(s.uid, s.num_tokens, (0,), LOGITS_LAST) for s in rows)
        nxt = StepPlan(
            step_id=next(self._step_ids),
            chunks=ahead,
            tables=tuple(TableUpdate(uid, tuple(b)) for uid, b in tables.items() if b),
            num_blocks=self.blocks.high_water,
            fingerprint=batch_fingerprint(self._lengths_after(list(ahead))),
        )
        self._launched(nxt)
        self.blocks.end_step()
        return nxt

    def _exports(self) -> tuple[BlockExport, ...]:
        """Prompt blocks of exporting sequences that became final in the steps run so far (the plan's
        ranks copy them before anything in the plan writes the pools)."""
        out: list[BlockExport] = []
        bs = self.blocks.block_size
        for seq in self.running:
            if seq.export_from is None or seq.aborted:
                continue
            final = min(seq.num_computed_tokens, len(seq.prompt_ids)) // bs
            table = self.blocks.table(seq.uid)
            out.extend(BlockExport(seq.uid, i, table[i]) for i in range(max(seq.exported, seq.export_from), final))
            seq.exported = max(seq.exported, final)
        return tuple(out)

    def _prompt_read_ahead(self, seq: Sequence, whole: int) -> int | None:
        """Where the next prompt chunk of `seq`, a sequence in a plan still in flight (a pipeline's other
        micro-batch), may start now: the end of what is in flight, when at least `whole` prompt tokens (a
        plan's budget) follow it. No chunk in flight samples then, and every stage runs plans in order, so
        the next chunk can follow at once instead of waiting for the pipeline to drain: a long prompt's
        chunks fill every micro-batch, not one (pipelined chunked prefill). A shorter tail waits, as any
        sequence in flight does: read ahead too, tails cost the 16-stream load of `scaling.py` ~8 %
        (docs/BENCHMARKS.md). None when the sequence waits."""
        flights = self._in_flight.get(seq.uid)
        if not flights or seq.aborted or seq.finished:
            return None
        end = flights[-1][1]
        return end if seq.num_tokens - end >= whole else None

    def _continue(self, seq: Sequence, start: int, budget: int, draft: _Draft, drafts: tuple[int, ...] = ()) -> int:
        """Plan the chunk of a running sequence from position `start`; returns the tokens it takes."""
        left = seq.num_tokens - start
        drafts = drafts[: budget - 1] if left == 1 else ()
        if drafts:
            new = self.blocks.allocate(seq.uid, start + 1 + len(drafts))
            if new is not None:  # else: no room for the drafts, decode plainly
                draft.tables.setdefault(seq.uid, []).extend(new)
                draft.chunks.append(Chunk(seq.uid, start, (*seq.token_slice(start, start + 1), *drafts), LOGITS_ALL))
                self._spend(draft, start, 1 + len(drafts), 1)
                return 1 + len(drafts)
        want = self._within_work(draft, start, min(left, budget, SCORING_ROWS if seq.scoring else left), left)
        if want == 0:
            return 0
        while (new := self.blocks.allocate(seq.uid, start + want)) is None:
            if not self._preempt_newer_than(seq):
                break
        if new is None:  # as much as its blocks and the free ones cover
            want = min(want, self.blocks.cover(seq.uid) - start)
            new = self.blocks.allocate(seq.uid, start + want) if want > 0 else None
        if new is None:
            if left == 1 and len(self.running) > 1:
                self._preempt(seq)  # every decoding row must advance each step; out of KV it yields
            return 0
        draft.tables.setdefault(seq.uid, []).extend(new)
        draft.chunks.append(_chunk(seq, start, want))
        self._spend(draft, start, want, left)
        return want

    def _within_work(self, draft: _Draft, start: int, want: int, left: int) -> int:
        """`want` tokens from `start`, fewer when a prompt chunk there would pass the step's work left."""
        if self.work is None or left == 1:  # a decode row is one token whatever it costs
            return want
        fits = self.work.tokens_within(start, draft.work)
        if draft.prompt_chunks == 0:
            fits = max(fits, MIN_CHUNK)
        return min(want, fits)

    def _spend(self, draft: _Draft, start: int, n: int, left: int, counted: bool = True) -> None:
        """Count a chunk's work; a running decode row's own token was counted when the step began (`counted`;
        its drafts were not)."""
        if self.work is None:
            return
        if left > 1:
            draft.work -= self.work.cost(start, n)
            draft.prompt_chunks += 1
        else:
            draft.work -= self.work.cost(start + counted, n - counted)

    def _admit(self, draft: _Draft, budget: int, rows: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size
               and len(draft.chunks) < rows):
            seq = self.waiting[0]
            if self.work is not None and draft.prompt_chunks and self.work.tokens_within(0, draft.work) == 0:
                break  # no prompt token fits the step's work left: no lookup either
            # Admit only when the whole prompt (+1 generated) fits, so a fresh sequence never
            # forces an older one out mid-prefill.
            reach = min(self.max_model_len, len(seq.prompt_ids) + seq.params.max_tokens)  # its longest
            if not self.blocks.can_admit(seq.num_tokens, reach):
                break
            # The last token is always computed: its logits give the next token. A prompt whose logprobs
            # are asked for is computed whole (vLLM does the same): a cached position has no logits.
            lookup = seq.token_slice(0, seq.num_tokens - 1) if not seq.scoring else []
            mark = self.blocks.stats.lookup_mark()
            m = self.blocks.match(seq.uid, lookup, seq.num_tokens, reach, seq.params.cache_salt)
            left = seq.num_tokens - m.tokens
            want = self._within_work(draft, m.tokens, min(left, budget, SCORING_ROWS if seq.scoring else budget), left)
            if want == 0 or self.blocks.allocate(seq.uid, m.tokens + want) is None:
                # The check above counted blocks the match then pinned (a partial hit's lender): it waits.
                # Blocks the match found on SSD are findable already, so their loads still run.
                draft.loads.extend(BlockLoad(key, block) for key, block in m.loads)
                self.blocks.free(seq.uid)
                self.blocks.stats.forget_lookup(mark)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = m.tokens
            if not seq.cache_counted:  # the prompt's hits, as usage reports them (as vLLM): a recompute's
                # lookup covers generated tokens too (it exceeded the prompt)
                seq.num_cached_tokens, seq.cache_counted = min(m.tokens, len(seq.prompt_ids)), True
                self.blocks.stats.query_tokens += len(seq.prompt_ids)
                self.blocks.stats.hit_tokens += seq.num_cached_tokens
            self.running.append(seq)
            draft.new.append(NewSequence(seq.uid, m.tokens, self.blocks.holder(seq.uid)))
            draft.loads.extend(BlockLoad(key, block) for key, block in m.loads)
            if m.copy is not None:
                draft.copies.append(BlockCopy(*m.copy))
            draft.tables[seq.uid] = list(self.blocks.table(seq.uid))
            draft.chunks.append(_chunk(seq, seq.num_computed_tokens, want))
            self._spend(draft, m.tokens, want, left, counted=False)
            budget -= want

    def _reap(self) -> list[Finished]:
        """Drop finished and aborted sequences; their KV is freed by this step's plan."""
        ended: list[Finished] = []
        for seq in list(self.running):
            if seq.aborted and not seq.finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
                ended.append(Finished(seq, FinishReason.ABORT))
            if seq.finished:
                self._leave(seq)
        for seq in [s for s in self.waiting if s.aborted or s.finished]:
            self.waiting.remove(seq)
            # Finished while waiting: the engine found a stop string in the tokens of a step after the
            # next step, which preempted it, was planned. Admitted again, it ran untracked until an empty
            # chunk failed the step (every request of the batch a 503; under TP/PP the server stopped).
            if not seq.finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
                ended.append(Finished(seq, FinishReason.ABORT))
        return ended

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._in_flight.pop(seq.uid, None)
        self._trims.pop(seq.uid, None)  # its KV goes entirely
        self._to_remove.append(seq.uid)
        self.blocks.free(seq.uid)

    def _preempt_newer_than(self, seq: Sequence) -> bool:
        """Free KV by sending the most recently admitted sequence back to wait (recompute)."""
        if self.running[-1] is seq:
            return False
        self._preempt(self.running[-1])
        return True

    def _preempt(self, victim: Sequence) -> None:
        self._leave(victim)
        victim.status = SeqStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def recompute_unloaded(self, plan: StepPlan, missing: frozenset[bytes],
                           later: tuple[StepPlan, ...] = ()) -> list[int]:
        """Some rank could not read blocks `plan` loaded (`missing`: their keys), so their KV there is
        garbage: no lookup may find them again, and every sequence holding one, or a copy from one, goes
        back to wait and is recomputed (its tokens so far kept, as a preemption). `later`: plans submitted
        after `plan` and still in flight (a pipeline's micro-batches), planned while its blocks were
        findable: their copies from one count too. Call before `update` takes the plan's results, which
        then skips those sequences (and so do later plans' updates). Returns their uids."""
        bad = self.blocks.forget_loaded([(x.key, x.block) for x in plan.loads if x.key in missing])
        bad |= {c.dst for p in (plan, *later) for c in p.copies if c.src in bad}
        hit = [s for s in self.running if not s.finished and bad.intersection(self.blocks.table(s.uid))]
        for seq in reversed(hit):  # each goes to the queue's front: the oldest ends up first
            self._preempt(seq)
            seq.cache_counted = False  # the hits it counted were not loaded: its recompute's lookup counts
        return [s.uid for s in hit]

    def _lengths_after(self, chunks: list[Chunk]) -> dict[int, int]:
        """Positions every rank holds per sequence once this plan is applied: plans still in flight are
        applied before it on every rank, so their chunks count."""
        lengths = {s.uid: self._in_flight[s.uid][-1][1] if s.uid in self._in_flight else s.num_computed_tokens
                   for s in self.running}
        for c in chunks:
            lengths[c.uid] = c.start + len(c.token_ids)
        return lengths

    # -- results ----------------------------------------------------------
    def kept(self, step_id: int, uids) -> set[int]:
        """Of `uids`, those whose tokens from plan `step_id` `update` will keep: not those that left, or were
        preempted (maybe re-admitted), while the plan was in flight. Their sampler state must not record
        the token either (grammar, penalties, the seed's draw count), or it runs one token ahead of the
        output the sequence keeps."""
        running = {s.uid for s in self.running}
        return {u for u in uids if u in running and (f := self._in_flight.get(u)) and f[0][0] == step_id}

    def update(self, plan: StepPlan, sampled: dict[int, list[int]]) -> tuple[list[Finished], dict[int, list[int]]]:
        """Apply a step's results: advance computed counts, append the tokens each sequence got (one, or for
        a verified chunk its accepted drafts plus one), commit full blocks, roll rejected drafts back.
        Returns the sequences that finished and the tokens each sequence actually took (a run stops at
        EOS, a stop token or max_tokens: nothing after them is kept)."""
        by_uid = {s.uid: s for s in self.running}
        finished: list[Finished] = []
        taken: dict[int, list[int]] = {}
        for chunk in plan.chunks:
            seq = by_uid.get(chunk.uid)
            flights = self._in_flight.get(chunk.uid)
            if seq is None or not flights or flights[0][0] != plan.step_id:
                continue  # left (or was preempted, maybe re-admitted) while this plan was in flight
            del flights[0]
            if not flights:
                del self._in_flight[chunk.uid]
            end = chunk.start + len(chunk.token_ids)
            tokens = sampled.get(chunk.uid)
            verify = chunk.verifies(seq.num_tokens)
            if verify:
                if seq.finished:  # ended meanwhile: it leaves, and its unverified KV is never committed
                    continue
                if tokens is None or not 1 <= len(tokens) <= len(chunk.token_ids):
                    raise ValueError(f"uid {chunk.uid}: {tokens!r} is not a verify outcome for {chunk}")
                end = chunk.start + len(tokens)  # the current token and the accepted drafts hold KV
            elif tokens and end < seq.num_tokens:  # a prompt chunk short of the end samples nothing (a scoring one)
                raise ValueError(f"uid {chunk.uid}: sampled {tokens!r} for a chunk ending at {end} of {seq.num_tokens}")
            if seq.finished or not tokens:
                # A stop string found in a speculative run shortened the sequence after this plan was made:
                # positions past its end hold KV of dropped tokens, never committed (they were keyed short)
                seq.num_computed_tokens = min(end, seq.num_tokens)
                self._commit(seq)
                continue
            if seq.params.max_tokens == 0:  # its prompt is computed (and scored): nothing is generated
                seq.num_computed_tokens = end
                self._commit(seq)
                self.finish(seq, FinishReason.LENGTH)
                finished.append(Finished(seq, FinishReason.LENGTH))
                continue
            kept: list[int] = []
            reason = None
            for token in tokens:
                seq.output_ids.append(token)
                kept.append(token)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            taken[chunk.uid] = kept
            seq.num_computed_tokens = min(end, seq.num_tokens)
            self._commit(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(Finished(seq, reason))
            elif verify and seq.num_computed_tokens < chunk.start + len(chunk.token_ids):
                self.blocks.trim(seq.uid, seq.num_computed_tokens)
                self._trims[seq.uid] = Trim(seq.uid, seq.num_computed_tokens, len(self.blocks.table(seq.uid)))
        return finished, taken

    def _commit(self, seq: Sequence) -> None:
        before = self.blocks.stats.committed
        saves = self.blocks.commit(seq.uid, seq.token_slice, seq.num_computed_tokens)
        self._saves.extend(BlockSave(block, key) for block, key in saves)
        if seq.num_computed_tokens <= len(seq.prompt_ids):  # every block this made findable is the prompt's
            seq.num_written_tokens += (self.blocks.stats.committed - before) * self.blocks.block_size

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (EOS, length, stop string); it leaves the batch next step."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if self._length_reached(seq):
            return FinishReason.LENGTH
        return None

    def _length_reached(self, seq: Sequence, ahead: int = 0) -> bool:
        """`seq` has reached max_tokens or the model's length, or will have after `ahead` more tokens."""
        return (len(seq.output_ids) + ahead >= seq.params.max_tokens
                or seq.num_tokens + ahead >= self.max_model_len)

    def fail_all(self) -> list[Sequence]:
        """Finish every sequence with an error (the executor died); returns them."""
        seqs = [s for s in itertools.chain(self.running, self.waiting) if not s.finished]
        for seq in seqs:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ERROR
        for seq in self.running:
            self.blocks.free(seq.uid)
        self.running.clear()
        self._in_flight.clear()
        self.waiting.clear()
        return seqs


def _chunk(seq: Sequence, start: int, n: int) -> Chunk:
    ids = seq.token_slice(start, start + n)  # decode: just the last token, not a copy of all
    if seq.scoring and start + n >= seq.scored:  # it holds positions whose logits score a prompt token
        return Chunk(seq.uid, start, tuple(ids), LOGITS_ALL)
    return Chunk(seq.uid, start, tuple(ids), LOGITS_LAST if start + n == seq.num_tokens else LOGITS_NONE)
