"""The block manager (leader only): which KV blocks each sequence holds, which are cached, which are free.

Pure bookkeeping over block ids, after vLLM's KVCacheManager: the KV arrays
live on every rank (kv/store.py) and change only through the ops a StepPlan
carries (block tables, copies, SSD loads and saves), so every rank holds the
same blocks at the same ids by construction.

- A block holds `block_size` consecutive positions of one sequence, in every
  layer. Blocks are ref-counted: a prefix-cache hit maps the cached blocks
  into the new sequence's table (no copy); a match that ends inside a block
  copies the shared tokens into a fresh block (copy-on-write: cached blocks
  are never written again).
- A full block is *committed* once its tokens are final (after the step that
  computed them): its key (hash chain of its tokens, kv/keys.py) makes it
  findable, and it is written through to the SSD tier.
- Free blocks come from three places, in this order: blocks never cached, ids
  never used yet (so the pool grows only as far as it is used), and cached
  blocks nobody holds, least recently used first (the RAM tier of the prefix
  cache). The budget is exact: `num_blocks` blocks, whatever the mix.
- The SSD tier's LRU order and TTL go by its files' mtimes, which only its own
  loads and writes refresh: a prefix served from RAM all day would expire there
  first. A RAM hit therefore refreshes the block's file (a plan's `touches`),
  or writes it again where the tier no longer lists it, at most once per
  REFRESH_SECONDS a key.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from meshlm.kv.keys import CacheSalt, chain_key


REFRESH_SECONDS = 60.0  # a RAM-hot block's SSD file is refreshed at most this often


def admit_tokens(length: int, reach: int | None) -> int:
    """Positions a sequence of `length` tokens needs to be admitted: its own and the next token's, unless
    it generates none (`reach` = length: echo with max_tokens 0 of a prompt that fills the context, which
    asked for one position more than the whole KV store and waited at the head of the queue for ever)."""
    return length + 1 if reach is None or reach > length else length


class KeyIndex(Protocol):
    """What the block manager asks of the SSD tier (counts and booleans, never arrays)."""

    def __contains__(self, key: bytes) -> bool:
        """The block is listed (its file may still turn out bad)."""
        ...

    def prefetch(self, key: bytes) -> bool:
        """The block is readable and verified: a plan may load it."""
        ...

    def forget(self, key: bytes) -> None:
        """A rank could not load the block: never list it again."""
        ...


@dataclass
class CacheStats:
    hits_ram: int = 0  # blocks
    hits_ssd: int = 0
    hits_received: int = 0  # blocks a prefill server sent (disaggregated prefill), not read from the SSD tier
    query_tokens: int = 0  # prompt tokens looked up at their first admission (vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # of them, served from the cache (usage's cached_tokens; vLLM's prefix_cache_hits)
    load_failures: int = 0  # blocks some rank could not load (its copy gone or bad): recomputed
    hits_partial: int = 0  # matches that ended inside a block
    partial_tokens: int = 0  # tokens those partial blocks lent
    misses: int = 0  # lookups that found no usable block
    committed: int = 0  # blocks that became findable
    evictions: int = 0  # cached blocks reused for something else

    # What a lookup counts in RAM: a lookup that admits nothing (no room, or no work left in the step) is
    # made again at the next step, and counted each time (a 100K-token cached prefix: 3,000 hits a step).
    # The SSD tier's hits stay: those blocks were read, and the retry finds them in RAM.
    LOOKUP = ("hits_ram", "hits_partial", "partial_tokens", "misses")

    def lookup_mark(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.LOOKUP)

    def forget_lookup(self, mark: tuple[int, ...]) -> None:
        """Uncount the lookups since `mark` (lookup_mark), whose sequence was not admitted."""
        for name, value in zip(self.LOOKUP, mark):
            setattr(self, name, value)


@dataclass
class Match:
    """What a prefix lookup gave a new sequence (its blocks are already in the sequence's table)."""

    tokens: int = 0  # positions whose KV the sequence now holds (once the ops below ran)
    copy: tuple[int, int, int] | None = None  # (lender block, destination block, tokens): partial block
    loads: list[tuple[bytes, int]] = field(default_factory=list)  # (key, block): read from the SSD tier


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys of its committed (full, final) blocks
    root: bytes = b""  # its chain's first parent (the salt's root, or its request's cache_salt's)


class _Children:
    """Committed RAM blocks under one parent key, sorted by their tokens: the block sharing the most
    leading tokens with a query sorts right before or after it."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], int]] = []

    def add(self, tokens: tuple[int, ...], block: int) -> None:
        bisect.insort(self.entries, (tokens, block))

    def remove(self, tokens: tuple[int, ...], block: int) -> None:
        i = bisect.bisect_left(self.entries, (tokens, block))
        if i < len(self.entries) and self.entries[i] == (tokens, block):
            del self.entries[i]

    def longest(self, query: tuple[int, ...]) -> tuple[int | None, int]:
        """(block, shared leading tokens) of the entry sharing the most leading tokens with `query`."""
        i = bisect.bisect_left(self.entries, (query,))
        best: tuple[int | None, int] = (None, 0)
        for tokens, block in self.entries[max(i - 1, 0) : i + 1]:
            n = common_prefix(tokens, query)
            if n > best[1]:
                best = (block, n)
        return best


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: CacheSalt | None = None,
                 ssd: KeyIndex | None = None, partial: bool = True, stats: CacheStats | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`salt`: None turns the prefix cache off (blocks are never committed or shared).
        `partial`: let a match end inside a block (by copying the shared tokens)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt
        self.ssd = ssd
        self.partial = partial
        self.stats = stats or CacheStats()
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._placed: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # committed block -> (parent, tokens)
        self._by_key: dict[bytes, int] = {}
        self._children: dict[bytes, _Children] = collections.defaultdict(_Children)
        self._uncached: list[int] = []  # heap of free blocks holding nothing findable (lowest id first)
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._fresh = 0  # ids below this have been handed out at least once
        self._seqs: dict[int, _Seq] = {}
        self._pinned: list[int] = []  # lenders held until the step's plan is built
        self._clock = clock
        self._refreshed: dict[bytes, float] = {}  # cached key -> when a RAM hit last refreshed its SSD file
        self._touches: list[bytes] = []  # for the next plan: SSD files to refresh
        self._rewrites: list[tuple[int, bytes]] = []  # for the next plan: (block, key) to write again

    # -- counts ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._uncached) + (self.num_blocks - self._fresh) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def high_water(self) -> int:
        """Block ids in use so far: every rank's pool must hold at least this many blocks."""
        return self._fresh

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_admit(self, length: int, reach: int | None = None) -> bool:
        """A sequence of `length` tokens fits whole, with room for the token it generates next. `reach`:
        the most tokens it may grow to (kv/context_blocks.py places by it)."""
        return self.blocks_for(admit_tokens(length, reach)) <= self.num_free

    def cover(self, uid: int) -> int:
        """Positions `uid` could hold with its blocks and every free one."""
        return (len(self.table(uid)) + self.num_free) * self.block_size

    def holder(self, uid: int) -> int:
        """The rank holding all of `uid`'s KV, or -1: every rank holds its share (kv/context_blocks.py)."""
        return -1

    def table(self, uid: int) -> list[int]:
        return self._seqs[uid].blocks

    def __contains__(self, uid: int) -> bool:
        return uid in self._seqs

    # -- allocation ---------------------------------------------------------
    def _can_take(self) -> bool:
        return bool(self._uncached) or self._fresh < self.num_blocks or bool(self._cached_free)

    def _take(self) -> int | None:
        if self._uncached:
            block = heapq.heappop(self._uncached)
        elif self._fresh < self.num_blocks:
            block, self._fresh = self._fresh, self._fresh + 1
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            self._forget(block)
            self.stats.evictions += 1
        else:
            return None
        self._refs[block] = 1
        return block

    def allocate(self, uid: int, tokens: int) -> list[int] | None:
        """Grow `uid`'s table to cover `tokens` positions; the new block ids, or None (nothing changed)
        when too few blocks are free."""
        seq = self._seqs.setdefault(uid, _Seq())
        want = self.blocks_for(tokens) - len(seq.blocks)
        if want <= 0:
            return []
        if want > self.num_free:
            return None
        new = [self._take() for _ in range(want)]
        seq.blocks.extend(new)  # type: ignore[arg-type]
        return new  # type: ignore[return-value]

    def take_block(self) -> int | None:
        """One free block held outside any sequence (kv/context_blocks.py lends it per rank), or None."""
        return self._take()

    def return_block(self, block: int) -> None:
        """Give back a block from `take_block`."""
        self._release(block)

    def free(self, uid: int) -> None:
        """Release every block of `uid` (finished, aborted or preempted)."""
        seq = self._seqs.pop(uid, None)
        if seq is not None:
            # Tail first: among blocks freed together the tail is evicted first, so what stays cached
            # longest is the head of the prefix, which later requests can actually match.
            for block in reversed(seq.blocks):
                self._release(block)

    def trim(self, uid: int, tokens: int) -> None:
        """Keep `uid`'s first `tokens` positions: blocks past them are released. Only positions not yet
        committed may be trimmed (a speculative rollback never reaches a committed block)."""
        seq = self._seqs[uid]
        keep = self.blocks_for(tokens)
        if tokens < len(seq.keys) * self.block_size:
            raise ValueError(f"uid {uid}: trimming to {tokens} tokens would cut committed blocks")
        for block in seq.blocks[keep:]:
            self._release(block)
        del seq.blocks[keep:]

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if self._key_of[block] is not None:
            self._cached_free[block] = None  # most recently used last
        else:
            heapq.heappush(self._uncached, block)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached_free.pop(block, None)
        self._refs[block] += 1

    def _forget(self, block: int) -> None:
        key = self._key_of[block]
        if key is None:
            return
        self._key_of[block] = None
        del self._by_key[key]
        self._refreshed.pop(key, None)
        parent, tokens = self._placed.pop(block)
        self._children[parent].remove(tokens, block)
        if not self._children[parent].entries:
            del self._children[parent]

    def forget_loaded(self, loads: list[tuple[bytes, int]]) -> set[int]:
        """(key, block) pairs a plan loaded that some rank could not read: no lookup finds them again, in
        RAM or on the SSD tier. Returns the blocks; whoever holds one must be recomputed."""
        for key, block in loads:
            if self._key_of[block] == key:
                self._forget(block)
                if self._refs[block] == 0 and block in self._cached_free:
                    del self._cached_free[block]
                    heapq.heappush(self._uncached, block)
            if self.ssd is not None:
                self.ssd.forget(key)
        self.stats.load_failures += len(loads)
        return {block for _, block in loads}

    # -- the prefix cache ------------------------------------------------------
    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` (a prompt's chain) a lookup would find now, in RAM or listed
        on the SSD tier (counting only: nothing is read or held)."""
        n = 0
        for key in keys:
            if key not in self._by_key and (self.ssd is None or key not in self.ssd):
                break
            n += 1
        return n

    def match(self, uid: int, token_ids: list[int], length: int | None = None, reach: int | None = None,
              cache_salt: str | None = None) -> Match:
        """Map the longest cached prefix of `token_ids` into a new sequence's table.

        Whole blocks come from RAM (shared, no copy) or, failing that, from the
        SSD tier (loaded into a fresh block); then, when the next whole block
        misses, the committed RAM block under the same parent sharing the most
        leading tokens lends them (copied into a fresh block). Call `end_step`
        once the step's plan is built (lenders stay held until then). `length`, `reach`: the sequence's
        tokens now and at most (kv/context_blocks.py places by them); `cache_salt`: the request's (its
        blocks form a chain of their own)."""
        if uid in self._seqs:
            raise ValueError(f"uid {uid} already holds blocks")
        seq = self._seqs[uid] = _Seq()
        m = Match()
        if self.salt is None:
            return m
        seq.root = self.salt.root(cache_salt)
        bs, parent = self.block_size, seq.root
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            key = chain_key(parent, tokens)
            block = self._hit(key, parent, tokens, m)
            if block is None:
                break
            seq.blocks.append(block)
            seq.keys.append(key)
            m.tokens += bs
            parent = key
        need = None if length is None else self.blocks_for(length + 1) - len(seq.blocks)
        self._match_partial(seq, parent, tuple(token_ids[m.tokens : m.tokens + bs]), m, need)
        if m.tokens == 0 and len(token_ids) >= bs:
            self.stats.misses += 1
        return m

    def _hit(self, key: bytes, parent: bytes, tokens: tuple[int, ...], m: Match) -> int | None:
        block = self._by_key.get(key)
        if block is not None:
            self._hold(block)
            self.stats.hits_ram += 1
            if self.ssd is not None:
                self._refresh(key, block)
            return block
        # A free block first: a received block's prefetch sets it aside (pins it) for the load that follows,
        # which a match with nowhere to put it would never run.
        if self.ssd is None or not self._can_take() or not self.ssd.prefetch(key):
            return None
        block = self._take()
        self._commit(block, key, parent, tokens)  # findable at once: the load runs before any reader
        m.loads.append((key, block))
        if getattr(self.ssd, "last_tier", "ssd") == "received":
            self.stats.hits_received += 1
        else:
            self.stats.hits_ssd += 1
        return block

    def _match_partial(self, seq: _Seq, parent: bytes, query: tuple[int, ...], m: Match, need: int | None) -> None:
        """`need`: blocks the sequence still needs whole (None: unknown). A free lender held for the copy is
        one block fewer for it: where that leaves too few, no partial hit (the admission that follows would
        fail, wait, and find the same lender again every step: the sequence never ran)."""
        if not self.partial or not query or parent not in self._children:
            return
        lender, shared = self._children[parent].longest(query)
        if lender is None or shared >= self.block_size:
            return
        if need is not None and self.num_free - (self._refs[lender] == 0) < need:
            return
        self._hold(lender)
        self._pinned.append(lender)
        dest = self._take()
        if dest is None:
            return
        seq.blocks.append(dest)
        m.copy = (lender, dest, shared)
        m.tokens += shared
        self.stats.hits_partial += 1
        self.stats.partial_tokens += shared

    def _refresh(self, key: bytes, block: int) -> None:
        now = self._clock()
        if now - self._refreshed.get(key, -REFRESH_SECONDS) < REFRESH_SECONDS:
            return
        self._refreshed[key] = now
        if key in self.ssd:
            self._touches.append(key)
        else:  # evicted or expired there while hot here: its content is final, write it again
            self._rewrites.append((block, key))

    def take_refreshes(self) -> tuple[list[tuple[int, bytes]], list[bytes]]:
        """(blocks to write to the SSD tier again, keys whose files to refresh) since the last call: the
        next plan carries them. The blocks are held by the sequences that hit them this step."""
        rewrites, touches = self._rewrites, self._touches
        self._rewrites, self._touches = [], []
        return rewrites, touches

    def end_step(self) -> None:
        """The step's plan is built: lenders of partial matches may be reused from now on."""
        for block in self._pinned:
            self._release(block)
        self._pinned.clear()

    def commit(self, uid: int, tokens: Callable[[int, int], Sequence[int]], computed: int) -> list[tuple[int, bytes]]:
        """Make `uid`'s full blocks within its first `computed` (final) positions findable; returns the
        (block, key) pairs to write through to the SSD tier. `tokens(a, b)`: the sequence's ids [a, b)."""
        seq = self._seqs.get(uid)
        if seq is None or self.salt is None:
            return []
        bs = self.block_size
        parent = seq.keys[-1] if seq.keys else (seq.root or self.salt.root())
        saves = []
        while (len(seq.keys) + 1) * bs <= computed and len(seq.keys) < len(seq.blocks):
            i = len(seq.keys)
            ids = tuple(tokens(i * bs, (i + 1) * bs))
            if len(ids) < bs:  # the sequence is shorter than `computed` says: never key a block short
                break
            key = chain_key(parent, ids)
            block = seq.blocks[i]
            if key not in self._by_key and self._key_of[block] is None:
                self._commit(block, key, parent, ids)
                self.stats.committed += 1
                if self.ssd is not None and key not in self.ssd:
                    saves.append((block, key))
            seq.keys.append(key)
            parent = key
        return saves

    def _commit(self, block: int, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        self._key_of[block] = key
        self._by_key[key] = block
        self._placed[block] = (parent, tokens)
        self._children[parent].add(tokens, block)
