"""Collectives sized for the transport under them.

A tensor-parallel group on one machine may sum through shared memory instead (a SharedMemoryGroup,
transport/local_reduce.py), which takes any size in its own rounds.

MLX's ring backend (TCP) sums a message of 1 MiB or more in ~7-11 ms on this machine whatever its
size (2 ranks on 127.0.0.1, one core each), while 512 KiB takes ~0.3 ms: a 512-token prefill chunk of
a 1024-wide model reduced in one piece cost 8.2 ms per all-reduce, 16 of them per step; in 128-row
pieces it costs 1.6 ms (docs/BENCHMARKS.md, issue 17). So large sums go in pieces below that size.
"""

from __future__ import annotations

import mlx.core as mx

from meshlm.transport.local_reduce import SharedMemoryGroup

CHUNK_BYTES = 512 * 1024


def all_sum(x: mx.array, group, chunk_bytes: int = CHUNK_BYTES) -> mx.array:
    """`mx.distributed.all_sum` of `x` over `group`, in pieces of at most `chunk_bytes` along its
    second-to-last axis (the tokens of a (..., tokens, features) activation)."""
    if isinstance(group, SharedMemoryGroup):
        return group.all_sum(x)
    if x.nbytes <= chunk_bytes or x.ndim < 2:
        return mx.distributed.all_sum(x, group=group)
    row_bytes = x.nbytes // x.shape[-2]
    rows = max(1, chunk_bytes // max(1, row_bytes))
    n = x.shape[-2]
    if rows >= n:
        return mx.distributed.all_sum(x, group=group)
    parts = [mx.distributed.all_sum(x[..., i:i + rows, :], group=group) for i in range(0, n, rows)]
    return mx.concatenate(parts, axis=-2)
