"""The prefix cache: longest cached prefix lookup, restore into a sequence's KV, store after use.

The scheduler asks `match` (token ids in, a token count out: it never sees
arrays); the runner calls `restore` for the matched prefix and `store` for
every full block a sequence computed. Blocks live in the RAM pool and, when
enabled, are written through to the SSD tier; a RAM miss that hits on disk is
promoted back to RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from meshlm.cache.keys import CacheSalt, block_keys
from meshlm.cache.pool import Block, BlockPool
from meshlm.cache.ssd import SSDTier


@dataclass
class CacheStats:
    hits_ram: int = 0  # blocks
    hits_ssd: int = 0
    misses: int = 0  # lookups that found no usable block
    stored: int = 0


class PrefixCache:
    def __init__(self, salt: CacheSalt, pool: BlockPool, ssd: SSDTier | None = None) -> None:
        self.salt = salt
        self.block_size = salt.block_size
        self.pool = pool
        self.ssd = ssd
        if ssd is not None:
            pool.on_evict = self._spill
        self.stats = CacheStats()
        self._pinned: dict[bytes, int] = {}

    def match(self, token_ids: list[int]) -> int:
        """Tokens of the longest cached prefix of `token_ids` (whole blocks); pins them until `restore`."""
        n = 0
        for key in block_keys(token_ids, self.salt):
            if not self._ensure_in_ram(key):
                break
            self.pool.pin(key)
            n += self.block_size
        if n == 0 and len(token_ids) >= self.block_size:
            self.stats.misses += 1
        return n

    def _ensure_in_ram(self, key: bytes) -> bool:
        if key in self.pool:
            self.stats.hits_ram += 1
            return True
        if self.ssd is None or key not in self.ssd:
            return False
        block = self.ssd.load(key)
        if block is None:
            return False
        self.pool.put(key, block)
        self.stats.hits_ssd += 1
        return key in self.pool

    def release(self, token_ids: list[int]) -> None:
        """Unpin a matched prefix that will not be restored (the sequence left first)."""
        for key in block_keys(token_ids, self.salt):
            self.pool.unpin(key)

    def restore(self, token_ids: list[int]) -> list[tuple[mx.array, mx.array]]:
        """Per-layer (keys, values) of shape (1, kv_heads, len, head_dim) for a matched prefix; unpins it."""
        keys = block_keys(token_ids, self.salt)
        # Worker ranks never call `match`: their blocks may still be on disk only.
        blocks = [self.pool.get(k) or (self.pool.get(k) if self._ensure_in_ram(k) else None) for k in keys]
        self.release(token_ids)
        if any(b is None for b in blocks):
            raise KeyError(f"prefix block {keys[blocks.index(None)].hex()} is not cached on this rank")
        layers = len(blocks[0].keys)
        return [
            (mx.concatenate([b.keys[i] for b in blocks], axis=1)[None],
             mx.concatenate([b.values[i] for b in blocks], axis=1)[None])
            for i in range(layers)
        ]

    def _spill(self, key: bytes, block: Block) -> None:
        """A block leaving RAM goes to disk (if not there already) rather than being lost."""
        self.ssd.save(key, block)

    def store(self, token_ids: list[int], kv: list[tuple[mx.array, mx.array]], write_through: bool = True) -> int:
        """Keep every full block of a sequence's KV (per layer (1, H, >=len, D)) not cached yet.

        `write_through`: also queue them for the SSD tier now (prompts, after prefill); otherwise
        they reach disk only if evicted from RAM, which keeps disk writes off busy decode steps."""
        keys = block_keys(token_ids, self.salt)
        bs = self.block_size
        new = [(i, k) for i, k in enumerate(keys) if k not in self.pool and not (self.ssd and k in self.ssd)]
        for i, key in new:
            sl = slice(i * bs, (i + 1) * bs)
            block = Block([mx.contiguous(k[0, :, sl]) for k, _ in kv], [mx.contiguous(v[0, :, sl]) for _, v in kv])
            mx.eval(block.keys, block.values)
            self.pool.put(key, block)
            if self.ssd is not None and write_through:
                self.ssd.save(key, block)
        self.stats.stored += len(new)
        return len(new)
