"""The leader's KV blocks under context parallelism with `--cp-min-tokens`: split sequences and sequences
kept whole on one rank, over one id space.

A split sequence's block id stands for N*b positions, b on every rank
(kv/context_split.py); it comes from the ordinary block manager, prefix cache
and all. A sequence shorter than `--cp-min-tokens` T is kept whole on one rank,
its holder: b positions per block id, in that rank's pool only. The same id's
slots on the other ranks stay free for *their* whole sequences, so ids lent to
whole sequences are shared: one is taken from the block manager when a rank
needs a block and no shared id is free there, and given back when no rank uses
it any more. Every id is counted once, by the block manager: the budget stays
exact whatever the mix.

Placement: a new whole sequence goes to the rank whose whole sequences hold
the fewest blocks (ties: the lowest rank), decided once at admission by the
sequence's tokens then (prompt, plus output when a preempted sequence is
recomputed); it stays there as it grows, past T included. A sequence that
could grow (max_tokens, the model length) past what one rank's pools hold is
split whatever its length: alone, it could not advance on its holder. Whole
sequences do not use the prefix cache: their blocks hold another layout than
split ones, and a short prompt's prefix is short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from meshlm.kv.blocks import BlockManager, CacheStats, Match, admit_tokens


@dataclass
class WholeStats:
    """Counters that outlive one engine's block manager (a restart makes a new one)."""

    placed: list[int]  # whole sequences placed on each rank so far


@dataclass
class _Whole:
    holder: int
    table: list[int] = field(default_factory=list)


class ContextBlocks:
    """BlockManager's interface (what the scheduler and the engine use) over split and whole sequences."""

    def __init__(self, inner: BlockManager, ranks: int, rank_block: int, min_tokens: int,
                 whole_stats: WholeStats | None = None) -> None:
        if ranks < 2 or rank_block < 1 or min_tokens < 0:
            raise ValueError(f"context blocks: {ranks} ranks, {rank_block} positions per rank's block, "
                             f"--cp-min-tokens {min_tokens}")
        self.inner = inner
        self.ranks = ranks
        self.rank_block = rank_block  # b: positions a whole sequence keeps per block id
        self.min_tokens = min_tokens
        self._whole: dict[int, _Whole] = {}
        self._users: dict[int, list[bool]] = {}  # id lent to whole sequences -> which ranks use it
        self._spare: list[set[int]] = [set() for _ in range(ranks)]  # lent ids free on each rank
        self.whole_stats = whole_stats or WholeStats([0] * ranks)

    # -- what the engine and metrics read: the block manager's -----------------------------------------
    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    @property
    def num_used(self) -> int:
        return self.inner.num_used

    @property
    def num_cached(self) -> int:
        return self.inner.num_cached

    @property
    def high_water(self) -> int:
        return self.inner.high_water

    @property
    def stats(self) -> CacheStats:
        return self.inner.stats

    def whole_blocks(self) -> list[int]:
        """Block ids' slots whole sequences hold, per rank."""
        held = [0] * self.ranks
        for w in self._whole.values():
            held[w.holder] += len(w.table)
        return held

    def cached_prefix(self, keys: list[bytes]) -> int:
        return self.inner.cached_prefix(keys)

    def end_step(self) -> None:
        self.inner.end_step()

    def take_refreshes(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        return self.inner.take_refreshes()

    def forget_loaded(self, loads: list[tuple[bytes, int]]) -> set[int]:
        """Loaded blocks some rank could not read: only split sequences look the cache up and load."""
        return self.inner.forget_loaded(loads)

    # -- per sequence ----------------------------------------------------------------------------------
    def _wants_whole(self, length: int | None, reach: int | None) -> bool:
        """Shorter than T, and never longer than one rank's pools hold: a whole sequence that outgrew its
        holder could not advance even alone."""
        if length is None or length >= self.min_tokens:
            return False
        return reach is None or self._blocks(reach) <= self.inner.num_blocks

    def _place(self) -> int:
        held = self.whole_blocks()
        return min(range(self.ranks), key=lambda r: (held[r], r))

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.rank_block)

    def _free_on(self, rank: int) -> int:
        return len(self._spare[rank]) + self.inner.num_free

    def holder(self, uid: int) -> int:
        w = self._whole.get(uid)
        return -1 if w is None else w.holder

    def __contains__(self, uid: int) -> bool:
        return uid in self._whole or uid in self.inner

    def table(self, uid: int) -> list[int]:
        w = self._whole.get(uid)
        return self.inner.table(uid) if w is None else w.table

    def can_admit(self, length: int, reach: int | None = None) -> bool:
        if not self._wants_whole(length, reach):
            return self.inner.can_admit(length, reach)
        return self._blocks(admit_tokens(length, reach)) <= self._free_on(self._place())

    def cover(self, uid: int) -> int:
        w = self._whole.get(uid)
        if w is None:
            return self.inner.cover(uid)
        return (len(w.table) + self._free_on(w.holder)) * self.rank_block

    def match(self, uid: int, token_ids: list[int], length: int | None = None, reach: int | None = None,
              cache_salt: str | None = None) -> Match:
        """A sequence of `length` tokens (None: split) shorter than --cp-min-tokens, which can grow to at
        most `reach` tokens (None: unbounded) that one rank's pools hold, is placed whole, with no prefix
        lookup; any other goes to the block manager's."""
        if not self._wants_whole(length, reach):
            # length and reach too: the partial-match guard needs them (without, a lender that left too few
            # blocks was held every step and the sequence never admitted)
            return self.inner.match(uid, token_ids, length, reach, cache_salt)
        if uid in self:
            raise ValueError(f"uid {uid} already holds blocks")
        holder = self._place()
        self._whole[uid] = _Whole(holder)
        self.whole_stats.placed[holder] += 1
        return Match()

    def allocate(self, uid: int, tokens: int) -> list[int] | None:
        w = self._whole.get(uid)
        if w is None:
            return self.inner.allocate(uid, tokens)
        want = self._blocks(tokens) - len(w.table)
        if want <= 0:
            return []
        if want > self._free_on(w.holder):
            return None
        new = [self._take(w.holder) for _ in range(want)]
        w.table.extend(new)
        return new

    def free(self, uid: int) -> None:
        w = self._whole.pop(uid, None)
        if w is None:
            self.inner.free(uid)
            return
        if not w.table:  # placed, then not admitted after all (no room, or no work left in the step)
            self.whole_stats.placed[w.holder] -= 1
        for block in reversed(w.table):
            self._give(w.holder, block)

    def trim(self, uid: int, tokens: int) -> None:
        w = self._whole.get(uid)
        if w is None:
            self.inner.trim(uid, tokens)
            return
        keep = self._blocks(tokens)
        for block in w.table[keep:]:
            self._give(w.holder, block)
        del w.table[keep:]

    def commit(self, uid: int, tokens: Callable[[int, int], Sequence[int]], computed: int) -> list[tuple[int, bytes]]:
        return [] if uid in self._whole else self.inner.commit(uid, tokens, computed)

    # -- ids lent to whole sequences -------------------------------------------------------------------
    def _take(self, rank: int) -> int:
        """A block for `rank` (the caller checked `_free_on`)."""
        if self._spare[rank]:
            block = min(self._spare[rank])  # lowest first, like the block manager: pools grow no further
            self._spare[rank].discard(block)
        else:
            block = self.inner.take_block()
            if block is None:
                raise RuntimeError("context blocks: no free block although one was counted")
            self._users[block] = [False] * self.ranks
            for r in range(self.ranks):
                if r != rank:
                    self._spare[r].add(block)
        self._users[block][rank] = True
        return block

    def _give(self, rank: int, block: int) -> None:
        users = self._users[block]
        users[rank] = False
        if any(users):
            self._spare[rank].add(block)
            return
        del self._users[block]
        for spare in self._spare:
            spare.discard(block)
        self.inner.return_block(block)
