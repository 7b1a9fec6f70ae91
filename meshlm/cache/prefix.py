"""The prefix cache: longest cached prefix lookup, restore into a sequence's KV, store after use.

The scheduler asks `match` (token ids in, a token count out: it never sees
arrays); the runner calls `restore` for the matched prefix and `store` for
every full block a sequence computed. Blocks live in the RAM pool and, when
enabled, are written through to the SSD tier; a RAM miss that hits on disk is
promoted back to RAM.

Blocks are keyed by their whole token content, but a match may end inside a
block (token-granular, as mlx-lm's and SGLang's caches reuse): when the next
whole block misses, the RAM block under the same parent sharing the longest
run of leading tokens lends its first tokens. Their KV is the same whichever
such block lends it (attention is causal), so a rank that did not run `match`
can restore the same prefix from any block that starts with those tokens. The
commonest shared prefix, a chat template's system prompt, is often shorter than
one block (~30 tokens for SmolLM2's): whole blocks alone would never reuse it.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

import mlx.core as mx

from meshlm.cache.keys import CacheSalt, block_keys
from meshlm.cache.pool import Block, BlockPool
from meshlm.cache.ssd import SSDTier


@dataclass
class CacheStats:
    hits_ram: int = 0  # blocks
    hits_ssd: int = 0
    hits_partial: int = 0  # matches that ended inside a block
    partial_tokens: int = 0  # tokens those partial blocks lent
    misses: int = 0  # lookups that found no usable block
    stored: int = 0


class _Children:
    """The RAM blocks under one parent key, sorted by their token ids: the block sharing the longest
    run of leading tokens with a query sorts right before or after it."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], bytes]] = []

    def add(self, tokens: tuple[int, ...], key: bytes) -> None:
        i = bisect.bisect_left(self.entries, (tokens, key))
        if i == len(self.entries) or self.entries[i] != (tokens, key):
            self.entries.insert(i, (tokens, key))

    def remove(self, tokens: tuple[int, ...], key: bytes) -> None:
        i = bisect.bisect_left(self.entries, (tokens, key))
        if i < len(self.entries) and self.entries[i] == (tokens, key):
            del self.entries[i]

    def longest(self, query: tuple[int, ...]) -> tuple[bytes | None, int]:
        """(key, shared leading tokens) of the block sharing the most leading tokens with `query`."""
        i = bisect.bisect_left(self.entries, (query,))
        best: tuple[bytes | None, int] = (None, 0)
        for tokens, key in self.entries[max(i - 1, 0) : i + 1]:
            n = _shared(tokens, query)
            if n > best[1]:
                best = (key, n)
        return best


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, salt: CacheSalt, pool: BlockPool, ssd: SSDTier | None = None, partial: bool = True) -> None:
        """`partial`: let a match end inside a block (off under tensor parallelism, where a rank whose
        RAM lacks a lender block would have to stop the cluster; whole blocks it can read from disk)."""
        self.salt = salt
        self.block_size = salt.block_size
        self.pool = pool
        self.ssd = ssd
        self.partial = partial
        pool.on_evict = self._evicted
        self.stats = CacheStats()
        # Every RAM block's parent and tokens, for partial matches.
        self._children: dict[bytes, _Children] = collections.defaultdict(_Children)
        self._placed: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
        # Partial blocks pinned by `match`, by (parent, lent tokens), until restore or release.
        self._lent: dict[tuple[bytes, tuple[int, ...]], list[bytes]] = collections.defaultdict(list)

    def match(self, token_ids: list[int]) -> int:
        """Tokens of the longest cached prefix of `token_ids`; pins its blocks until `restore`."""
        n, parent, bs = 0, self.salt.root(), self.block_size
        for key in block_keys(token_ids, self.salt):
            if not self._ensure_in_ram(key, parent, token_ids[n : n + bs]):
                break
            self.pool.pin(key)
            n += bs
            parent = key
        if self.partial and parent in self._children:
            lender, shared = self._children[parent].longest(tuple(token_ids[n : n + bs]))
            if lender is not None:
                self.pool.pin(lender)
                self._lent[(parent, tuple(token_ids[n : n + shared]))].append(lender)
                self.stats.hits_partial += 1
                self.stats.partial_tokens += shared
                n += shared
        if n == 0 and len(token_ids) >= self.block_size:
            self.stats.misses += 1
        return n

    def _ensure_in_ram(self, key: bytes, parent: bytes, tokens: list[int]) -> bool:
        if key in self.pool:
            self.stats.hits_ram += 1
            return True
        if self.ssd is None or key not in self.ssd:
            return False
        block = self.ssd.load(key)
        if block is None:
            return False
        self._put(key, block, parent, tokens)
        self.stats.hits_ssd += 1
        return key in self.pool

    def _put(self, key: bytes, block: Block, parent: bytes, tokens: list[int]) -> None:
        self._placed[key] = (parent, tuple(tokens))
        self._children[parent].add(tuple(tokens), key)
        self.pool.put(key, block)  # may evict it again at once: `_evicted` forgets it then

    def release(self, token_ids: list[int]) -> None:
        """Unpin a matched prefix that will not be restored (the sequence left first)."""
        self._unpin(block_keys(token_ids, self.salt), self._take_lent(token_ids))

    def _unpin(self, keys: list[bytes], lender: bytes | None) -> None:
        for key in keys:
            self.pool.unpin(key)
        if lender is not None:
            self.pool.unpin(lender)

    def _take_lent(self, token_ids: list[int]) -> bytes | None:
        """The block `match` pinned for this prefix's partial tail, if it did."""
        whole = len(token_ids) // self.block_size * self.block_size
        if whole == len(token_ids):
            return None
        keys = block_keys(token_ids, self.salt)
        slot = (keys[-1] if keys else self.salt.root(), tuple(token_ids[whole:]))
        pinned = self._lent.get(slot)
        if not pinned:
            return None
        lender = pinned.pop()
        if not pinned:
            del self._lent[slot]
        return lender

    def restore(self, token_ids: list[int]) -> list[tuple[mx.array, mx.array]]:
        """Per-layer (keys, values) of shape (1, kv_heads, len, head_dim) for a matched prefix; unpins it."""
        bs = self.block_size
        keys = block_keys(token_ids, self.salt)
        parents = [self.salt.root(), *keys]
        # Worker ranks never call `match`: their blocks may still be on disk only.
        blocks = [
            self.pool.get(k) or (self.pool.get(k) if self._ensure_in_ram(k, p, token_ids[i * bs : (i + 1) * bs]) else None)
            for i, (k, p) in enumerate(zip(keys, parents))
        ]
        tail = len(token_ids) - len(keys) * bs
        pinned = self._take_lent(token_ids)
        lender = pinned
        if tail and lender is None:  # not matched on this rank: any RAM block starting with these tokens will do
            children = self._children.get(parents[-1])
            found, shared = children.longest(tuple(token_ids[-tail:])) if children else (None, 0)
            lender = found if shared == tail else None
        if tail:
            blocks.append(self.pool.get(lender) if lender is not None else None)
        self._unpin(keys, pinned)
        if any(b is None for b in blocks):
            missing = blocks.index(None)
            name = keys[missing].hex() if missing < len(keys) else f"lending {tail} tokens"
            raise KeyError(f"prefix block {name} is not cached on this rank")
        layers = len(blocks[0].keys)
        return [
            (mx.concatenate([b.keys[i] for b in blocks], axis=1)[None, :, : len(token_ids)],
             mx.concatenate([b.values[i] for b in blocks], axis=1)[None, :, : len(token_ids)])
            for i in range(layers)
        ]

    def _evicted(self, key: bytes, block: Block) -> None:
        """A block leaving RAM goes to disk (if not there already) rather than being lost."""
        placed = self._placed.pop(key, None)
        if placed is not None:
            parent, tokens = placed
            self._children[parent].remove(tokens, key)
            if not self._children[parent].entries:
                del self._children[parent]
        if self.ssd is not None:
            mx.eval(block.keys, block.values)  # stored RAM-only blocks may still be copying
            self.ssd.save(key, block)

    def store(self, token_ids: list[int], kv: list[tuple[mx.array, mx.array]], write_through: bool = True) -> int:
        """Keep every full block of a sequence's KV (per layer (1, H, >=len, D)) not cached yet.

        `write_through`: also queue them for the SSD tier now (prompts, after prefill); otherwise
        they reach disk only if evicted from RAM, which keeps disk writes off busy decode steps."""
        keys = block_keys(token_ids, self.salt)
        bs = self.block_size
        new = [(i, k) for i, k in enumerate(keys) if k not in self.pool and not (self.ssd and k in self.ssd)]
        blocks = []
        for i, _ in new:
            sl = slice(i * bs, (i + 1) * bs)
            blocks.append(Block([mx.contiguous(k[0, :, sl]) for k, _ in kv], [mx.contiguous(v[0, :, sl]) for _, v in kv]))
        copies = [a for b in blocks for a in (*b.keys, *b.values)]
        to_disk = self.ssd is not None and write_through
        if to_disk:
            mx.eval(copies)  # the SSD writer thread reads their bytes
        else:
            # RAM only: the copies run in stream order ahead of the next step instead of stalling the host
            # (a batch of sequences leaving at once has dozens of blocks); `_evicted` waits before a spill.
            mx.async_eval(copies)
        for (i, key), block in zip(new, blocks):
            self._put(key, block, keys[i - 1] if i else self.salt.root(), token_ids[i * bs : (i + 1) * bs])
            if to_disk:
                self.ssd.save(key, block)
        self.stats.stored += len(new)
        return len(new)
