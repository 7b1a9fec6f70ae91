"""Blocks a prefill server sent, waiting to be loaded like prefix-cache hits (disaggregated prefill).

The transfer threads put validated blocks here under their keys (the same hash
chain as the prefix cache, so a received block is found by the block
manager's lookup exactly like an SSD block); the engine's plan then loads them
into the pools and they leave. The tier is bounded in bytes: when a transfer
would overflow it, blocks are dropped from the end of a prompt's chain (a
dropped block is recomputed, never wrong). Thread-safe: transfers put, the engine
thread looks up and loads.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from meshlm.kv.store import BlockData


@dataclass(frozen=True)
class HostBlock:
    """A received block in host memory: no MLX array is made off the model's thread (an MLX op belongs
    to the stream of the thread that made it)."""

    keys: np.ndarray  # [layers, 1, kv_heads, block_size, head_dim]; bfloat16 travels as uint16
    values: np.ndarray
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def finite(self) -> bool:
        """Every value is finite: one NaN or inf would turn every later token of the prompt (and of any
        prompt sharing its prefix through the cache) into NaN. numpy, on the host: no MLX off the model's thread."""
        # 16-bit floats by their bits (all exponent bits set: inf or NaN): numpy's float16 isfinite is ~10x slower.
        exponent = {mx.bfloat16: 0x7F80, mx.float16: 0x7C00}.get(self.dtype)

        def ok(host: np.ndarray) -> bool:
            if exponent is not None:
                return not np.any((host.view(np.uint16) & exponent) == exponent)
            return bool(np.isfinite(host).all())
        return ok(self.keys) and ok(self.values)

    def to_device(self) -> BlockData:
        """Per layer (kv_heads, block_size, head_dim) MLX arrays; call on the model's thread."""
        def arrays(host: np.ndarray) -> list[mx.array]:
            if self.dtype == mx.bfloat16:
                return [mx.array(host[i, 0], dtype=mx.uint16).view(mx.bfloat16) for i in range(len(host))]
            return [mx.array(host[i, 0], dtype=self.dtype) for i in range(len(host))]
        return BlockData(arrays(self.keys), arrays(self.values))


# The group of blocks set aside for plans that never ran: no transfer's (job ids count from 1), evicted first,
# and never cut (nothing of theirs follows).
UNPINNED = -1


class ReceivedBlocks:
    """Received blocks by key, within `max_bytes`. A block a plan will load is *pinned* (`pin`, when the block
    manager's lookup finds it) until the plan's `load` takes it: neither a transfer's `put` into a full tier
    nor an aborted transfer's `discard` may take it away between the lookup and the load, which would make
    the engine recompute the prefix.

    A full tier makes room from the *end* of a transfer's chain: a block is only found after every block
    before it, so dropping a prompt's first block would make all its others useless (a prefill server
    computes concurrent jobs side by side, so their blocks arrive interleaved, and plain least-recently-
    received order dropped every prompt's first blocks first). The victim is the transfer that put least
    recently, other than the one putting (an abandoned transfer's leftovers go first); with none, the new
    block is dropped. A transfer that lost a block puts none after it: they would follow a gap."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("the received-block budget must be positive")
        self.max_bytes = max_bytes
        self._blocks: dict[bytes, HostBlock] = {}  # evictable
        self._group_of: dict[bytes, int] = {}  # the transfer that put each evictable block
        # Per transfer, least recently put first: its keys in chain order (stale entries are skipped) and
        # how many of them are still evictable here.
        self._groups: collections.OrderedDict[int, list[bytes]] = collections.OrderedDict()
        self._live: dict[int, int] = {}
        self._cut: set[int] = set()  # transfers that lost a block (until `end`)
        self._pinned: dict[bytes, HostBlock] = {}
        self._bytes = 0  # of both
        self._lock = threading.Lock()
        self.dropped = 0  # blocks evicted (or refused) before any plan loaded them

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks or key in self._pinned

    def put(self, key: bytes, data: HostBlock, group: int) -> None:
        """Block `key` of transfer `group` (its blocks come in chain order)."""
        size = data.nbytes
        with self._lock:
            if key in self._pinned:  # the same key is the same tokens' KV: keep the one a plan will load
                return
            if group in self._cut:
                self.dropped += 1
                return
            self._pop(key)
            while self._bytes + size > self.max_bytes:
                victim = next((g for g in self._groups if g != group), None)
                if victim is None:
                    break
                self._drop_last(victim)
            if self._bytes + size > self.max_bytes:
                self._cut.add(group)
                self.dropped += 1
                return
            self._add(key, data, group)
            self._groups.move_to_end(group)

    def end(self, group: int) -> None:
        """Transfer `group` puts nothing more."""
        with self._lock:
            self._cut.discard(group)

    def pin(self, key: bytes) -> bool:
        """Set the block aside for a plan that will load it; False if it is not here."""
        with self._lock:
            data = self._pinned.get(key)
            if data is None:
                data = self._pop(key)
                if data is not None:
                    self._bytes += data.nbytes  # still held, now pinned
            if data is not None:
                self._pinned[key] = data
            return data is not None

    def unpin_all(self) -> None:
        """Plans that pinned blocks will not run (the engine restarts): the blocks are evictable again, before
        any transfer's."""
        with self._lock:
            for key, data in self._pinned.items():
                self._bytes -= data.nbytes
                self._add(key, data, UNPINNED)
            self._pinned.clear()
            if UNPINNED in self._groups:
                self._groups.move_to_end(UNPINNED, last=False)

    def load(self, key: bytes) -> BlockData | None:
        """Take the block out (a plan is loading it into the pools; on the model's thread); None if it is
        not here."""
        with self._lock:
            data = self._take(key)
        return None if data is None else data.to_device()

    def forget(self, key: bytes) -> None:
        """Drop the block, pinned or not (a rank could not load it: it will never be loaded)."""
        with self._lock:
            self._take(key)

    def discard(self, keys: list[bytes]) -> None:
        """Forget an aborted transfer's blocks, but those a plan will load."""
        with self._lock:
            for key in keys:
                self._pop(key)

    def _add(self, key: bytes, data: HostBlock, group: int) -> None:
        self._blocks[key] = data
        self._group_of[key] = group
        self._groups.setdefault(group, []).append(key)
        self._live[group] = self._live.get(group, 0) + 1
        self._bytes += data.nbytes

    def _drop_last(self, group: int) -> None:
        """Evict the last evictable block `group` put; it puts none after it (hold the lock)."""
        keys = self._groups[group]
        while keys:
            key = keys.pop()
            if self._group_of.get(key) == group:
                self._pop(key)
                self.dropped += 1
                if group != UNPINNED:
                    self._cut.add(group)
                return

    def _take(self, key: bytes) -> HostBlock | None:
        """Remove a block, pinned or not, and its bytes from the count (hold the lock)."""
        data = self._pinned.pop(key, None)
        if data is None:
            return self._pop(key)
        self._bytes -= data.nbytes
        return data

    def _pop(self, key: bytes) -> HostBlock | None:
        """Remove an evictable block and its bytes from the count (hold the lock)."""
        data = self._blocks.pop(key, None)
        if data is None:
            return None
        self._bytes -= data.nbytes
        group = self._group_of.pop(key)
        self._live[group] -= 1
        if not self._live[group]:  # its list holds only stale keys now
            del self._live[group], self._groups[group]
        return data


class ReceivedThenSSD:
    """The block manager's view of both tiers (kv/blocks.py KeyIndex): received blocks first."""

    def __init__(self, received: ReceivedBlocks, ssd=None) -> None:
        self.received = received
        self.ssd = ssd
        self.last_tier = "ssd"  # which tier the last successful prefetch found its block in (the hit metrics)

    def __contains__(self, key: bytes) -> bool:
        return key in self.received or (self.ssd is not None and key in self.ssd)

    def prefetch(self, key: bytes) -> bool:
        """The block may be loaded by a plan: a received one is pinned until then (transfers go on meanwhile)."""
        if self.received.pin(key):
            self.last_tier = "received"
            return True
        self.last_tier = "ssd"
        return self.ssd is not None and self.ssd.prefetch(key)

    def forget(self, key: bytes) -> None:
        """A rank could not load the block: neither tier lists it again."""
        self.received.forget(key)
        if self.ssd is not None:
            self.ssd.forget(key)
