"""This rank's KV arrays: per layer, a K pool and a V pool of fixed-size blocks.

Layout per layer: (capacity * block_size, kv_heads, head_dim), token-major:
slot `b * block_size + i` holds position i of block b, all heads side by side.
A step's new K and V come out of the projections token-major too, so writing
them is a scatter of whole contiguous rows (a head-major pool made it an
element-wise strided scatter: measured ~5 % of a batched prefill); readers
view a gather as (kv_heads, tokens, head_dim), and the CPU decode kernel walks
each head with a stride. On disk a block is (kv_heads, block_size, head_dim)
per layer, as the SSD tier has always stored it.

Every write is an in-place update of the pool (MLX donates the buffer when
nothing else holds it): the engine launches a step only once the previous one
has finished, and every read of a pool (attention, block saves) is part of
the step that wrote it, so no pending reader ever forces a copy of a pool.
With the compiled CPU kernels a write is one `kv_write` node reading the
step's rows in place (`pool[slots] = rows` built six nodes per pool and
layer); a write whose input pool is still referenced copies it, as MLX's
scatter does, which is why the runner drops its own references first.
With the compiled CPU kernels the pools are reserved at the whole budget from
the start as zeros whose pages the kernel supplies on first write
(`untouched_zeros`): resident memory follows the blocks written and nothing is
ever copied. Otherwise (Metal, or no compiled kernels) they grow by doubling up
to `max_blocks`, copying: at GiB sizes on the CPU that stalled every stream for
seconds (docs/BENCHMARKS.md). Either way `nbytes` counts the blocks the load has
needed so far, doubling, never more than `--kv-cache-memory`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Union

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

INITIAL_BLOCKS = 16
# Pool dtypes numpy can view, so a block can be copied to host memory without MLX ops (bfloat16 cannot).
HOST_DTYPES = frozenset({mx.float32, mx.float16})
# A block's per-layer array: MLX, or numpy for a host copy (`KVStore.extract(..., host=True)`).
Array = Union[mx.array, np.ndarray]


@dataclass
class BlockData:
    """One block of every layer this rank holds: per layer (kv_heads, block_size, head_dim)."""

    keys: list[Array]
    values: list[Array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)


@dataclass(frozen=True)
class KVShape:
    num_layers: int  # layers this rank holds (a pipeline stage holds fewer)
    kv_heads: int  # this rank's share (tensor parallelism splits them)
    head_dim: int
    block_size: int
    dtype: mx.Dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer, K and V."""
        return 2 * self.num_layers * self.kv_heads * self.block_size * self.head_dim * self.dtype.size


# Zeros of a shape and dtype whose memory is resident only where written (cpu_ops.untouched_zeros).
Reserve = Callable[[list[int], mx.Dtype], mx.array]
# (pool, slots (T,), rows (1, kv_heads, T, head_dim)) -> the pool with the rows written (cpu_ops.kv_write: one
# graph node, in place; the portable scatter below builds six per pool and layer).
WriteRows = Callable[[mx.array, mx.array, mx.array], mx.array]


class KVStore:
    def __init__(self, shape: KVShape, max_blocks: int, initial_blocks: int = INITIAL_BLOCKS,
                 reserve: Reserve | None = None, write_rows: WriteRows | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("the KV budget holds no block")
        self.shape = shape
        self.max_blocks = max_blocks
        self.capacity = 0  # blocks the load may use so far; with `reserve` the pools already hold max_blocks
        self.reserved = reserve is not None
        self._write_rows = write_rows
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        if reserve is not None:
            rows = [max_blocks * shape.block_size, shape.kv_heads, shape.head_dim]
            mb = max_blocks * shape.block_bytes / 1e6
            try:
                self.keys = [reserve(rows, shape.dtype) for _ in range(shape.num_layers)]
                self.values = [reserve(rows, shape.dtype) for _ in range(shape.num_layers)]
                mx.eval(self.keys, self.values)
            except RuntimeError as exc:  # the address space or the kernel's overcommit limit said no
                raise ValueError(f"cannot reserve {mb:.0f} MB for the KV pools ({exc}); lower --kv-cache-memory") from None
            log.info("KV pools reserved for %d blocks (%.0f MB), resident as blocks are written", max_blocks, mb)
        self.ensure(min(initial_blocks, max_blocks))

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated for KV on this rank (never above max_blocks * block_bytes)."""
        return self.capacity * self.shape.block_bytes

    def ensure(self, blocks: int) -> None:
        """Hold at least `blocks` blocks (doubling, capped at the budget)."""
        if blocks <= self.capacity:
            return
        if blocks > self.max_blocks:
            raise ValueError(f"{blocks} KV blocks requested, the budget holds {self.max_blocks}")
        new = min(max(blocks, 2 * self.capacity), self.max_blocks)
        if self.reserved:
            self.capacity = new
            return
        t0 = time.perf_counter()
        s = self.shape
        extra = ((new - self.capacity) * s.block_size, s.kv_heads, s.head_dim)
        grow = [mx.zeros(extra, dtype=s.dtype) for _ in range(s.num_layers)]
        if self.capacity:
            self.keys = [mx.concatenate([k, z]) for k, z in zip(self.keys, grow)]
            self.values = [mx.concatenate([v, mx.zeros_like(z)]) for v, z in zip(self.values, grow)]
        else:
            self.keys, self.values = grow, [mx.zeros(extra, dtype=s.dtype) for _ in range(s.num_layers)]
        old, self.capacity = self.capacity, new
        mx.eval(self.keys, self.values)
        # Growing copies every pool: a step stalls for it (seconds at GiBs where fresh pages fault slowly).
        log.info("KV pools grew from %d to %d blocks (%.0f MB) in %.2f s", old, new, self.nbytes / 1e6,
                 time.perf_counter() - t0)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store new positions: `k`, `v` (1, kv_heads, T, head_dim), the head-major view mlx-lm's attention
        layers hand their cache (token-major underneath), at `slots` (T,)."""
        if self._write_rows is not None and k.dtype == v.dtype == self.keys[layer].dtype == mx.float32:
            self.keys[layer] = self._write_rows(self.keys[layer], slots, k)
            self.values[layer] = self._write_rows(self.values[layer], slots, v)
            return
        self.keys[layer][slots] = k.squeeze(0).transpose(1, 0, 2)
        self.values[layer][slots] = v.squeeze(0).transpose(1, 0, 2)

    def replace(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Take a layer's pools as an op that wrote them returned them (model/decode_layer.py): the old
        arrays are dropped here, before the step runs, so the op may update them in place."""
        self.keys[layer], self.values[layer] = keys, values

    def block_slots(self, block: int, tokens: int | None = None) -> mx.array:
        bs = self.block_size
        return mx.arange(block * bs, block * bs + (bs if tokens is None else tokens))

    def extract(self, blocks: list[int], host: bool = False) -> list[BlockData]:
        """Row-contiguous copies of these blocks (gathers: never views that would pin the pools), one
        gather per layer for all of them: a gather per block and layer cost a committed prompt's worth of
        ~0.1 ms ops on the step's critical path. Each block's arrays are views of that copy.

        With `host` and a pool dtype numpy can view, the copies are numpy arrays gathered from the pools'
        memory directly: the SSD writer only needs bytes, and the MLX way (a lazy gather per pool, a
        slice per block and layer, an eval) cost each step ~0.2 ms per saved block against ~0.05,
        measured on the 72M llama's TP shard, which under tensor parallelism the other ranks wait for."""
        if not blocks:
            return []
        s = self.shape
        if host and s.dtype in HOST_DTYPES:
            index = np.asarray(blocks)

            def per_block(pool: mx.array) -> Array:  # (blocks, kv_heads, block_size, head_dim)
                # A view of the pool's memory (evaluating it if a write is pending), dropped on return: a
                # view kept alive would make the next write copy the whole pool instead of updating it.
                rows = np.asarray(pool).reshape(-1, s.block_size, s.kv_heads, s.head_dim)
                return np.ascontiguousarray(rows[index].transpose(0, 2, 1, 3))
        else:
            slots = mx.concatenate([self.block_slots(b) for b in blocks])
            shape = (len(blocks), s.block_size, s.kv_heads, s.head_dim)

            def per_block(pool: mx.array) -> Array:
                return mx.contiguous(mx.take(pool, slots, axis=0).reshape(shape).transpose(0, 2, 1, 3))

        keys, values = [per_block(k) for k in self.keys], [per_block(v) for v in self.values]
        return [BlockData([k[i] for k in keys], [v[i] for v in values]) for i in range(len(blocks))]

    def copy(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first `tokens` positions of block `src` into `dst`, evaluated now: a pending read of
        the pool would keep the next write from updating it in place."""
        src_slots, dst_slots = self.block_slots(src, tokens), self.block_slots(dst, tokens)
        parts = [(mx.take(k, src_slots, axis=0), mx.take(v, src_slots, axis=0))
                 for k, v in zip(self.keys, self.values)]
        mx.eval(parts)
        for layer, (k, v) in enumerate(parts):  # (tokens, heads, dim) -> write's (1, heads, tokens, dim) view
            self.write(layer, dst_slots, k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])

    def load(self, blocks: list[int], data: list[BlockData]) -> None:
        """Put blocks read from the SSD tier into `blocks` (shapes were checked by the reader): one write
        per layer for all of them (a write per block and layer cost ~0.1 ms each on CPU)."""
        if not blocks:
            return
        slots = mx.concatenate([self.block_slots(b) for b in blocks])
        dtype = self.shape.dtype

        def rows(arrays: list[mx.array]) -> mx.array:  # (heads, bs, dim) per block -> (1, heads, blocks * bs, dim)
            return mx.concatenate(arrays, axis=1).astype(dtype)[None]

        for layer in range(self.shape.num_layers):
            self.write(layer, slots, rows([d.keys[layer] for d in data]), rows([d.values[layer] for d in data]))

    def check_block(self, data: BlockData) -> str | None:
        """Why `data` cannot be a block of this store (None when it can)."""
        s = self.shape
        want = (s.kv_heads, s.block_size, s.head_dim)
        if len(data.keys) != s.num_layers or len(data.values) != s.num_layers:
            return f"{len(data.keys)} layers, this rank holds {s.num_layers}"
        for a in (*data.keys, *data.values):
            if tuple(a.shape) != want:
                return f"a layer of shape {tuple(a.shape)}, expected {want}"
        return None
