"""Exact attention over a sequence split across context-parallel ranks, and the forward around it.

A rank runs its share of each row's new tokens through every matrix alone;
only attention needs the other ranks (model/context_batch.py has the index
arithmetic, docs/CONTEXT_PARALLEL.md the design):
- pass-KV: one all_gather of every rank's K and V of the step's rows; each
  rank attends its queries to its own K and V while the gather runs (on a
  second stream, `RingContext.comm`), then to the other ranks', and merges
  the two partials by log-sum-exp;
- pass-Q: one all_gather of the queries, each rank attends all of them to
  its own KV, and one all_gather of the partial outputs with their
  log-sum-exps, merged exactly (`merge_partials`).
Both are graph operations of `mx.distributed`, inside the step's one
evaluation, so the step's deadline and the cluster's watchdog cover them as
they cover tensor parallelism's all-reduces.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import mlx.core as mx

from meshlm.kv.context_split import ContextSplit
from meshlm.kv.store import KVStore
from meshlm.model.adapt import ModelParts
from meshlm.model.attention import AttentionBackend, LayerKV, TokenPositions, merge_partials
from meshlm.model.context_batch import LOCAL, MIN_NEW_FOR_KV, PASS_KV, REPLICATED, ContextBatch
from meshlm.model.forward import narrows, rows_after_attention

EVAL_SCORES = 1 << 22  # attention blocks with this many scores are evaluated as they are built


def attend_blocks(q: mx.array, keys: mx.array, values: mx.array, blocks, backend: AttentionBackend,
                  scale: float, slots: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Causal attention of position-sorted queries q (n, H, D) to position-sorted keys/values (S, Hk, D),
    block by block (context_batch.query_blocks). Returns the output (n, H, D) and log-sum-exp (n, H);
    a query with no key gets zeros and -inf, which merge as no contribution. `slots`: keys and values are
    the pools, the row's keys their rows at `slots` (S,), read in place where the kernel can."""
    H, D = q.shape[1], q.shape[2]
    if backend.partial_counts and len(blocks) > 1 and q.dtype == mx.float32:
        # A kernel that takes each query's count of visible keys needs no blocks: one call reads each key
        # once for every query, where 128-query blocks re-read them (a 32K-token prefill's chunk on a CP=2
        # rank: 57 -> 45 ms an attention).
        visible = max(blk.visible for blk in blocks)
        if visible > 0:
            counts = mx.concatenate([blk.counts for blk in blocks])
            if slots is not None:
                return backend.partial_paged(q, keys, values, slots[:visible], scale, counts)
            return backend.partial(q, keys[:visible].transpose(1, 0, 2), values[:visible].transpose(1, 0, 2),
                                   None, scale, counts)
    if slots is not None:
        keys, values = mx.take(keys, slots, axis=0), mx.take(values, slots, axis=0)
    # Head-major and contiguous once per row, so each block reads a prefix of it with no copy.
    keys, values = mx.contiguous(keys.transpose(1, 0, 2)), mx.contiguous(values.transpose(1, 0, 2))
    outs, lses = [], []
    for blk in blocks:
        n = blk.stop - blk.start
        if blk.visible == 0:
            outs.append(mx.zeros((n, H, D), dtype=q.dtype))
            lses.append(mx.full((n, H), -mx.inf, dtype=mx.float32))
            continue
        o, lse = backend.partial(q[blk.start:blk.stop], keys[:, :blk.visible], values[:, :blk.visible], blk.mask,
                                 scale, blk.counts)
        outs.append(o)
        lses.append(lse)
        if n * blk.visible * H >= EVAL_SCORES:
            # MLX would otherwise run every block's score matmul before any softmax, and a block's
            # log-sum-exp keeps its score-sized sibling alive until the layer ends: all of them held at
            # once made a 16K-token prefill memory-bound (1.8x slower). Every rank evaluates what it
            # built so far, collectives included, in the order the chain fixes.
            mx.eval(o, lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return mx.concatenate(outs), mx.concatenate(lses)


@dataclass(frozen=True)
class RingContext:
    """What a context-parallel rank's runner needs beyond one process's."""

    split: ContextSplit
    group: object  # the mx.distributed group of the CP ranks
    algorithm: str = "auto"  # auto | pass-kv | pass-q
    min_new_for_kv: int = MIN_NEW_FOR_KV  # auto: this many new tokens pick pass-KV whatever the cached share
    kv_heads: int = 1
    q_heads: int = 1
    # pass-KV's gather on a second CPU stream (MLX runs each on its own thread), so the transfer
    # overlaps this rank's attention to its own KV. False: on the default stream, after it.
    overlap: bool = True
    streams: "CommStreams" = field(default_factory=lambda: CommStreams())

    def comm(self):
        """The stream this thread's collectives that overlap run on, or None for the default stream."""
        return self.streams.get() if self.overlap else None


class CommStreams:
    """One second CPU stream per thread that runs steps: an MLX stream belongs to the thread that made it."""

    def __init__(self) -> None:
        self._by_thread: dict[int, object] = {}

    def get(self):
        me = threading.get_ident()
        if me not in self._by_thread:
            self._by_thread[me] = mx.new_stream(mx.cpu)  # collectives run on the CPU, even beside a GPU
        return self._by_thread[me]


def tie(x: mx.array, prev: mx.array | None) -> mx.array:
    """`x`, made to depend on `prev` by adding zero times one of its (finite) elements. mx.depends says
    the same but made a 16K-token prefill 1.4x slower."""
    return x if prev is None else x + (prev.reshape(-1)[:1] * 0).astype(x.dtype)


class Collectives:
    """A step's collectives, chained: each one's input depends on the previous one's output. MLX runs a
    graph in dependency order, and a rank whose result ignores a collective (no query of its own in a
    row, say) would otherwise run the ranks' collectives in different orders, or skip one: a
    deadlock, or worse, two same-shaped gathers silently swapped."""

    def __init__(self) -> None:
        self.last: mx.array | None = None  # the previous collective's output (its first element is finite)

    def gather(self, x: mx.array, group, stream=None) -> mx.array:
        """`stream`: where the gather runs (None: the default stream)."""
        self.last = mx.distributed.all_gather(tie(x, self.last), group=group, stream=stream)
        return self.last

    def sum(self, x: mx.array, group) -> mx.array:
        self.last = mx.distributed.all_sum(tie(x, self.last), group=group)
        return self.last


class RingLayerKV(LayerKV):
    """The cache one mlx-lm attention layer gets under context parallelism (LayerKV's contract)."""

    def __init__(self, store: KVStore, layer: int, batch: ContextBatch, group, chain: Collectives,
                 backend: AttentionBackend, needed: bool = True, comm=None) -> None:
        self.store, self.layer, self.batch, self.group, self.chain = store, layer, batch, group, chain
        self.backend, self.comm = backend, comm
        self.needed = needed  # False: only this layer's K and V matter (see forward_ring)
        self.offset = TokenPositions(batch.positions)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b = self.batch
        if b.count and b.write_index is not None:  # replicated: only the tokens this rank holds
            self.store.write(self.layer, b.slots, mx.take(keys, b.write_index, axis=2),
                             mx.take(values, b.write_index, axis=2))
        elif b.count:  # padding tokens write nothing
            self.store.write(self.layer, b.slots, keys[:, :, : b.count], values[:, :, : b.count])
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        if not self.needed:
            return mx.zeros_like(queries)
        q = queries.squeeze(0).transpose(1, 0, 2)  # (width, H, D)
        pool_k, pool_v = self.store.keys[self.layer], self.store.values[self.layer]
        algorithm = self.batch.algorithm
        out = self._pass_kv(q, pool_k, pool_v, scale) if algorithm == PASS_KV else \
            self._local(q, pool_k, pool_v, scale) if algorithm == LOCAL else \
            self._replicated(q, pool_k, pool_v, scale) if algorithm == REPLICATED else \
            self._pass_q(q, pool_k, pool_v, scale)
        return tie(out, self.chain.last).transpose(1, 0, 2)[None]

    def _gather(self, x: mx.array) -> mx.array:
        return self.chain.gather(x, self.group)

    def _pass_kv(self, q, pool_k, pool_v, scale) -> mx.array:
        b = self.batch
        mine = mx.stack([mx.take(pool_k, b.kv_local, axis=0), mx.take(pool_v, b.kv_local, axis=0)])
        every = self.chain.gather(mine[None], self.group, self.comm)  # (ranks, 2, kv_width, Hk, D)
        if self.comm is not None:
            mx.async_eval(every)  # the transfer starts now, on the comm stream's thread
        rows = [row for row in b.rows if row.own.stop > row.own.start]
        # Every row's attention to this rank's own KV first: its large blocks are evaluated as they are
        # built (attend_blocks), beside the transfer, before anything waits for the gathered keys.
        own = [self._attend_pools(q, row, row.own_blocks, pool_k, pool_v, scale) for row in rows]
        Hk, D = every.shape[-2], every.shape[-1]
        keys = every[:, 0].reshape(-1, Hk, D)
        values = every[:, 1].reshape(-1, Hk, D)
        outs = []
        for row, mine_part in zip(rows, own):
            k, v = mx.take(keys, row.kv_index, axis=0), mx.take(values, row.kv_index, axis=0)
            theirs = attend_blocks(q[row.own], k, v, row.blocks, self.backend, scale)
            outs.append(merge_partials([mine_part, theirs])[0])
        return self._padded(outs, q)

    def _local(self, q, pool_k, pool_v, scale) -> mx.array:
        """Rows kept whole: this rank's own rows against its own pools, nothing gathered."""
        b = self.batch
        outs = [self._attend_pools(q, row, row.blocks, pool_k, pool_v, scale)[0]
                for row in b.rows if row.own.stop > row.own.start and not row.paged]
        if b.paged is not None:
            outs.append(self._paged(mx.take(q, b.paged.q_index, axis=0), pool_k, pool_v, scale)[0])
            outs = [mx.take(mx.concatenate(outs) if len(outs) > 1 else outs[0], b.out_order, axis=0)]
        return self._padded(outs, q)

    def _replicated(self, q, pool_k, pool_v, scale) -> mx.array:
        """Every row's query against this rank's KV of its row; the ranks' partials gathered and merged in
        rank order, the same bits on every rank."""
        H, D = q.shape[1], q.shape[2]
        o, lse = self._paged(q, pool_k, pool_v, scale)
        every = self._gather(mx.concatenate([o.astype(mx.float32), lse[..., None]], axis=-1))
        return _merge_ranks(every.reshape(self.batch.split.ranks, -1, H, D + 1)).astype(q.dtype)

    def _paged(self, q, pool_k, pool_v, scale) -> tuple[mx.array, mx.array]:
        """The step's rows of one query (`ContextBatch.paged`), q (R, H, D), in place in the pools."""
        p = self.batch.paged
        return self.backend.decode_partial(q, pool_k, pool_v, p.tables, p.lengths, self.batch.split.block_size,
                                           scale)

    def _attend_pools(self, q, row, blocks, pool_k, pool_v, scale) -> tuple[mx.array, mx.array]:
        """This rank's queries of `row` against the row's KV in this rank's own pools: output and lse."""
        return attend_blocks(q[row.own], pool_k, pool_v, blocks, self.backend, scale, row.kv_slots)

    def _padded(self, outs: list[mx.array], q: mx.array) -> mx.array:
        """The rows' outputs in order, then zeros for the padding."""
        b = self.batch
        if b.width > b.count:
            outs.append(mx.zeros((b.width - b.count, *q.shape[1:]), dtype=q.dtype))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def _pass_q(self, q, pool_k, pool_v, scale) -> mx.array:
        b = self.batch
        every_q = self._gather(q)  # (ranks * width, H, D)
        H, D = q.shape[1], q.shape[2]
        outs, lses = [], []
        for row in b.rows:
            if row.paged:
                continue
            o, lse = attend_blocks(mx.take(every_q, row.q_index, axis=0), pool_k, pool_v, row.blocks, self.backend,
                                   scale, row.kv_slots)
            outs.append(o.astype(mx.float32))
            lses.append(lse)
        if b.paged is not None:  # after the other rows' partials, where q_order looks for them
            o, lse = self._paged(mx.take(every_q, b.paged.q_index, axis=0), pool_k, pool_v, scale)
            outs.append(o.astype(mx.float32))
            lses.append(lse)
        outs.append(mx.zeros((1, H, D), dtype=mx.float32))
        lses.append(mx.full((1, H), -mx.inf, dtype=mx.float32))
        partial = mx.concatenate([mx.concatenate(outs), mx.concatenate(lses)[..., None]], axis=-1)
        partial = mx.take(partial, b.q_order, axis=0)  # (ranks * width, H, D + 1), in gathered order
        every = self._gather(partial).reshape(b.split.ranks, -1, H, D + 1)
        r, w = b.split.rank, b.width
        return _merge_ranks(every[:, r * w:(r + 1) * w]).astype(q.dtype)  # every rank's partial of its queries


def _merge_ranks(partials: mx.array) -> mx.array:
    """(ranks, n, H, D + 1) partial outputs with their log-sum-exps last, merged in rank order: (n, H, D)."""
    D = partials.shape[-1] - 1
    return merge_partials([(partials[i, ..., :D], partials[i, ..., D]) for i in range(partials.shape[0])])[0]


def forward_ring(parts: ModelParts, batch: ContextBatch, store: KVStore, group,
                 backend: AttentionBackend, comm=None) -> tuple[mx.array | None, mx.array]:
    """This rank's share of a context-parallel step. Returns the logits of `batch.logit_rows` (on a rank
    with the LM head; else None) and what must be evaluated for this rank's part of the collectives (the
    last one: the chain makes it depend on every other; None when the step has none)."""
    chain = Collectives()
    h = parts.embed(batch.tokens[None])
    last = len(parts.layers) - 1
    picked = None
    for i, layer in enumerate(parts.layers):
        # A step without logits (a prefill chunk) needs only the last layer's K and V, not its attention:
        # one process's lazy graph never evaluates it, and here every rank skips it alike, collectives
        # included (its large blocks would otherwise be evaluated as they are built).
        needed = bool(batch.logit_rows) or i < last
        kv = RingLayerKV(store, i, batch, group, chain, backend, needed, comm)
        if i == last and batch.logit_rows and narrows(layer):  # as one process: only the wanted rows go on
            picked = rows_after_attention(layer, h, kv, batch.logit_index)[0]
        else:
            h = layer(h, None, kv)
    if not batch.logit_rows:
        return None, chain.last
    if picked is None:
        picked = mx.take(h[0], batch.logit_index, axis=0)
    if batch.algorithm == REPLICATED:  # every rank holds every row's last hidden state: rank 0 projects
        if batch.split.rank != 0:
            return None, chain.last
        logits = parts.head(picked[None])[0]
        return logits, logits
    picked = picked * batch.logit_mine[:, None].astype(picked.dtype)
    picked = chain.sum(picked, group)  # every wanted row, from the rank that holds it
    if batch.split.rank != 0:  # the leader samples: only it projects to the vocabulary
        return None, picked
    logits = parts.head(picked[None])[0]
    return logits, logits
