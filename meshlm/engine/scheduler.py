"""The scheduler: decides each step by token accounting.

Every sequence wants `num_tokens - num_computed_tokens` more tokens run. Each
step the scheduler hands out a token budget: one token to every decoding
sequence first (so running streams never stall behind a long prompt), then
prefill chunks to sequences still reading their prompt, then admits waiting
sequences while batch size and the KV budget allow. When the KV budget is full
the most recently admitted sequence is preempted and later recomputed.

It never touches arrays: it sees uids, lengths and token ids only.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Protocol

from meshlm.config import SchedulerConfig
from meshlm.engine.plan import Chunk, NewSequence, StepPlan, batch_fingerprint
from meshlm.engine.request import FinishReason, Sequence, SeqStatus


class PrefixIndex(Protocol):
    """What the scheduler needs of the prefix cache: counts, never arrays."""

    def match(self, token_ids: list[int]) -> int: ...


class QueueFull(Exception):
    """The bounded waiting queue is full; the caller should retry later."""


@dataclass(frozen=True)
class Finished:
    seq: Sequence
    reason: FinishReason


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_budget_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        prefix: PrefixIndex | None = None,
    ) -> None:
        self.prefix = prefix
        self.config = config
        self.kv_budget_tokens = kv_budget_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._to_remove: list[int] = []  # uids whose KV ranks must drop next step
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    # -- intake -----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(seq)

    def abort(self, uid: int) -> None:
        """Mark a sequence cancelled; it leaves the batch (and frees KV) at the next step."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.uid == uid and not seq.finished:
                seq.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._to_remove)

    @property
    def kv_tokens_used(self) -> int:
        return sum(s.num_computed_tokens for s in self.running)

    # -- the step ---------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[Finished]]:
        """Plan one step. Returns the plan and sequences that ended without running (aborts)."""
        ended = self._reap()
        budget = self.config.max_tokens_per_step
        chunks: list[Chunk] = []
        free_kv = self.kv_budget_tokens - self.kv_tokens_used
        # Decode and continuing prefill for running sequences, oldest first;
        # only newer sequences are preempted, so the oldest always progresses.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted for an older one
                continue
            want = min(seq.remaining, budget)
            while want > free_kv and self._preempt_newer_than(seq):
                free_kv = self.kv_budget_tokens - self.kv_tokens_used - _planned(chunks)
            want = min(want, free_kv)
            if want <= 0:
                if seq.remaining == 1 and len(self.running) > 1:
                    # Every decoding row must advance each step; out of KV it yields.
                    self._preempt(seq)
                continue
            chunks.append(_chunk(seq, want))
            budget -= want
            free_kv -= want
        new = self._admit(chunks, budget, free_kv)
        plan = StepPlan(
            step_id=next(self._step_ids),
            new=tuple(new),
            chunks=tuple(chunks),
            removed=tuple(self._to_remove),
            fingerprint=batch_fingerprint(self._lengths_after(chunks)),
        )
        self._to_remove = []
        return plan, ended

    def _admit(self, chunks: list[Chunk], budget: int, free_kv: int) -> list[NewSequence]:
        new: list[NewSequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            # Admit only when the whole prompt (+1 generated) fits in KV, so a
            # fresh sequence never forces an older one out mid-prefill.
            if seq.num_tokens + 1 > free_kv:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            ids = seq.all_ids
            if self.prefix is not None:
                # The last token is always computed: its logits give the next token.
                seq.num_cached_tokens = self.prefix.match(ids[: len(ids) - 1])
            seq.num_computed_tokens = seq.num_cached_tokens
            self.running.append(seq)
            prefix_ids = tuple(ids[: seq.num_cached_tokens])
            new.append(NewSequence(seq.uid, seq.num_cached_tokens, seq.params, prefix_ids))
            want = min(seq.remaining, budget)
            chunks.append(_chunk(seq, want))
            budget -= want
            free_kv -= seq.num_tokens + 1
        return new

    def _reap(self) -> list[Finished]:
        """Drop finished and aborted sequences; their KV is freed by this step's plan."""
        ended: list[Finished] = []
        for seq in list(self.running):
            if seq.aborted and not seq.finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
                ended.append(Finished(seq, FinishReason.ABORT))
            if seq.finished:
                self.running.remove(seq)
                self._to_remove.append(seq.uid)
        for seq in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
            ended.append(Finished(seq, FinishReason.ABORT))
        return ended

    def _preempt_newer_than(self, seq: Sequence) -> bool:
        """Free KV by sending the most recently admitted sequence back to wait (recompute)."""
        if self.running[-1] is seq:
            return False
        self._preempt(self.running[-1])
        return True

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self._to_remove.append(victim.uid)
        victim.status = SeqStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_cached_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _lengths_after(self, chunks: list[Chunk]) -> dict[int, int]:
        lengths = {s.uid: s.num_computed_tokens for s in self.running}
        for c in chunks:
            lengths[c.uid] = c.start + len(c.token_ids)
        return lengths

    # -- results ----------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Finished]:
        """Apply a step's results: advance computed counts, append sampled tokens, finish."""
        by_uid = {s.uid: s for s in self.running}
        finished: list[Finished] = []
        for chunk in plan.chunks:
            seq = by_uid.get(chunk.uid)
            if seq is None:
                continue
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            token = sampled.get(chunk.uid)
            if token is None or seq.finished:
                continue
            seq.output_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(Finished(seq, reason))
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (EOS, length, stop string); it leaves the batch next step."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def fail_all(self) -> list[Sequence]:
        """Finish every sequence with an error (the executor died); returns them."""
        seqs = [s for s in itertools.chain(self.running, self.waiting) if not s.finished]
        for seq in seqs:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ERROR
        self.running.clear()
        self.waiting.clear()
        return seqs


def _chunk(seq: Sequence, n: int) -> Chunk:
    start = seq.num_computed_tokens
    ids = seq.token_slice(start, start + n)  # decode: just the last token, not a copy of all
    return Chunk(seq.uid, start, tuple(ids), sample=start + n == seq.num_tokens)


def _planned(chunks: list[Chunk]) -> int:
    return sum(len(c.token_ids) for c in chunks)
