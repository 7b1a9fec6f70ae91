"""Which positions of a sequence each context-parallel rank holds, and where in its pools.

Context parallelism (docs/CONTEXT_PARALLEL.md) splits every sequence's KV
over N ranks. The split is made per block, so the leader's block manager,
prefix cache and StepPlans stay exactly those of one process: a logical block
of N*b positions (b = `--block-size`, even) has the same block id on every
rank, and each rank's pool keeps only its b positions of it.

Within a logical block the positions are cut into 2N chunks of b/2 and rank i
holds chunks i and 2N-1-i (the load-balanced split of Meta's context
parallelism paper): every rank holds the same number of positions of every
full block, early and late ones alike, so causal attention work is even
however long the sequence, and a prefix-cache hit or a decode token lands on
the rank that holds its position in any sequence. Decode tokens append in the
same pattern: the current block fills chunk by chunk, so the ranks' shares of
a sequence never differ by more than b/2 positions.

A rank's b slots of a block hold its positions in order (chunk i, then chunk
2N-1-i), so the positions it holds below any length are a prefix of its
slots: a partial block copy, a trim or a length is a local count.

A sequence shorter than `--cp-min-tokens` is not split (`WholeRow`): one rank
(its holder) keeps every position, b per block id of its own pool, and the
other ranks hold none of it (kv/context_blocks.py allocates those ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ContextSplit:
    ranks: int  # N
    rank: int  # this rank, 0..N-1
    block_size: int  # b: positions of each logical block a rank holds (its pool's block size)

    def __post_init__(self) -> None:
        if self.ranks < 1 or not 0 <= self.rank < self.ranks:
            raise ValueError(f"context-parallel rank {self.rank} of {self.ranks}")
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"context parallelism needs an even --block-size, got {self.block_size}")

    @property
    def half(self) -> int:
        return self.block_size // 2

    @property
    def logical_block(self) -> int:
        """Positions per block id in the leader's tables: every rank's share together."""
        return self.ranks * self.block_size

    def for_rank(self, rank: int) -> "ContextSplit":
        return ContextSplit(self.ranks, rank, self.block_size)

    # -- position -> holder --------------------------------------------------------------------------
    def owner(self, positions: np.ndarray) -> np.ndarray:
        chunk = (np.asarray(positions) % self.logical_block) // self.half
        return np.where(chunk < self.ranks, chunk, 2 * self.ranks - 1 - chunk)

    def local_index(self, positions: np.ndarray) -> np.ndarray:
        """Index of each position among its holder's b slots of its block."""
        p = np.asarray(positions)
        chunk = (p % self.logical_block) // self.half
        return np.where(chunk < self.ranks, 0, self.half) + p % self.half

    def held(self, start: int, end: int) -> np.ndarray:
        """The positions in [start, end) this rank holds, ascending."""
        p = np.arange(start, end, dtype=np.int64)
        return p[self.owner(p) == self.rank]

    def local_count(self, length: int) -> int:
        """How many of positions [0, length) this rank holds."""
        full, rest = divmod(length, self.logical_block)
        lo = self.rank * self.half
        hi = (2 * self.ranks - 1 - self.rank) * self.half
        part = min(max(rest - lo, 0), self.half) + min(max(rest - hi, 0), self.half)
        return full * self.block_size + part

    def slots(self, blocks: tuple[int, ...] | list[int], positions: np.ndarray) -> np.ndarray:
        """Pool slots of positions this rank holds, in a sequence with block table `blocks`."""
        p = np.asarray(positions, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        return table[p // self.logical_block] * self.block_size + self.local_index(p)

    # -- a whole sequence ----------------------------------------------------------------------------
    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """Per rank, the entries of `values` (one per position 0..len-1) that rank holds, in order."""
        owner = self.owner(np.arange(len(values)))
        return [np.asarray(values)[owner == r] for r in range(self.ranks)]

    def join(self, parts: list[np.ndarray]) -> np.ndarray:
        """The inverse of `split`: every rank's entries back in position order."""
        n = sum(len(x) for x in parts)
        owner = self.owner(np.arange(n))
        out = np.empty((n, *np.asarray(parts[0]).shape[1:]), dtype=np.asarray(parts[0]).dtype)
        for r, part in enumerate(parts):
            out[owner == r] = part
        return out


@dataclass(frozen=True)
class WholeRow:
    """`ContextSplit`'s position arithmetic for a sequence kept whole on rank `holder`: the holder's pool
    keeps positions p at block p // b, slot p % b of its own table; every other rank holds nothing."""

    holder: int
    rank: int  # this rank
    block_size: int  # b, as ContextSplit's

    def for_rank(self, rank: int) -> "WholeRow":
        return WholeRow(self.holder, rank, self.block_size)

    def held(self, start: int, end: int) -> np.ndarray:
        return np.arange(start, end, dtype=np.int64) if self.rank == self.holder else np.zeros(0, dtype=np.int64)

    def local_count(self, length: int) -> int:
        return length if self.rank == self.holder else 0

    def slots(self, blocks: tuple[int, ...] | list[int], positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions, dtype=np.int64)
        return np.asarray(blocks, dtype=np.int64)[p // self.block_size] * self.block_size + p % self.block_size


def row_split(split: ContextSplit, holder: int) -> "ContextSplit | WholeRow":
    """How rank `split.rank` holds a row: split (holder -1) or kept whole on rank `holder`."""
    return split if holder < 0 else WholeRow(holder, split.rank, split.block_size)
