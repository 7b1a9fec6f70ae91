"""The RAM block pool: KV blocks behind opaque keys, ref-counted, evicted LRU.

A block holds one rank's shard of `block_size` tokens of KV for every layer.
Blocks in use (pinned between a prefix match and its restore) are never
evicted. The byte limit moves: the engine shrinks it while running sequences
need the memory (`trim`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass
class Block:
    keys: list[mx.array]  # per layer: (kv_heads, block_size, head_dim)
    values: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)


class BlockPool:
    def __init__(self, budget_bytes: int, on_evict: Callable[[bytes, Block], None] | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict  # e.g. spill to the SSD tier
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()
        self._refs: collections.Counter[bytes] = collections.Counter()
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, key: bytes, block: Block) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        self._blocks[key] = block
        self.nbytes += block.nbytes
        self.trim(self.budget_bytes)

    def pin(self, key: bytes) -> None:
        self._refs[key] += 1

    def unpin(self, key: bytes) -> None:
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._refs[key]

    def trim(self, limit: int) -> int:
        """Evict least-recently-used unpinned blocks until at most `limit` bytes remain."""
        limit = min(limit, self.budget_bytes)
        if self.nbytes <= limit:
            return 0
        evicted = 0
        for key in list(self._blocks):
            if self.nbytes <= limit:
                break
            if self._refs[key]:
                continue
            block = self._blocks.pop(key)
            self.nbytes -= block.nbytes
            evicted += 1
            if self.on_evict is not None:
                self.on_evict(key, block)
        self.evictions += evicted
        return evicted
