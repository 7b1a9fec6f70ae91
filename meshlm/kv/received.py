"""Blocks a prefill server sent, waiting to be loaded like prefix-cache hits (disaggregated prefill).

The transfer threads put validated blocks here under their keys (the same hash
chain as the prefix cache, so a received block is found by the block
manager's lookup exactly like an SSD block); the engine's plan then loads them
into the pools and they leave. The tier is bounded in bytes: when a transfer
would overflow it, the least recently received blocks are dropped (a dropped
block is recomputed, never wrong). Thread-safe: transfers put, the engine
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


class ReceivedBlocks:
    """Received blocks by key, within `max_bytes`. A block a plan will load is *pinned* (`pin`, when the block
    manager's lookup finds it) until the plan's `load` takes it: neither a transfer's `put` into a full tier
    nor an aborted transfer's `discard` may take it away between the lookup and the load, which would make
    the engine recompute the prefix. A put that finds only pinned blocks to evict drops its own."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("the received-block budget must be positive")
        self.max_bytes = max_bytes
        self._blocks: collections.OrderedDict[bytes, HostBlock] = collections.OrderedDict()  # evictable, LRU
        self._pinned: dict[bytes, HostBlock] = {}
        self._bytes = 0  # of both
        self._lock = threading.Lock()
        self.dropped = 0  # blocks evicted (or refused) before any plan loaded them

    def __len__(self) -> int:
        return len(self._blocks) + len(self._pinned)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks or key in self._pinned

    def put(self, key: bytes, data: HostBlock) -> None:
        size = data.nbytes
        with self._lock:
            if key in self._pinned:  # the same key is the same tokens' KV: keep the one a plan will load
                return
            self._pop(key)
            while self._blocks and self._bytes + size > self.max_bytes:
                self._pop(next(iter(self._blocks)))
                self.dropped += 1
            if self._bytes + size <= self.max_bytes:
                self._blocks[key] = data
                self._bytes += size
            else:
                self.dropped += 1

    def pin(self, key: bytes) -> bool:
        """Set the block aside for a plan that will load it; False if it is not here."""
        with self._lock:
            data = self._pinned.get(key)
            if data is None:
                data = self._blocks.pop(key, None)
            if data is not None:
                self._pinned[key] = data
            return data is not None

    def unpin_all(self) -> None:
        """Plans that pinned blocks will not run (the engine restarts): the blocks are evictable again."""
        with self._lock:
            self._blocks.update(self._pinned)
            self._pinned.clear()

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

    def _take(self, key: bytes) -> HostBlock | None:
        """Remove a block, pinned or not, and its bytes from the count (hold the lock)."""
        data = self._pinned.pop(key, None)
        if data is None:
            return self._pop(key)
        self._bytes -= data.nbytes
        return data

    def _pop(self, key: bytes) -> HostBlock | None:
        """Remove an unpinned block and its bytes from the count (hold the lock)."""
        data = self._blocks.pop(key, None)
        if data is not None:
            self._bytes -= data.nbytes
        return data


class ReceivedThenSSD:
    """The block manager's view of both tiers (kv/blocks.py KeyIndex): received blocks first."""

    def __init__(self, received: ReceivedBlocks, ssd=None) -> None:
        self.received = received
        self.ssd = ssd

    def __contains__(self, key: bytes) -> bool:
        return key in self.received or (self.ssd is not None and key in self.ssd)

    def prefetch(self, key: bytes) -> bool:
        """The block may be loaded by a plan: a received one is pinned until then (transfers go on meanwhile)."""
        return self.received.pin(key) or (self.ssd is not None and self.ssd.prefetch(key))

    def forget(self, key: bytes) -> None:
        """A rank could not load the block: neither tier lists it again."""
        self.received.forget(key)
        if self.ssd is not None:
            self.ssd.forget(key)
