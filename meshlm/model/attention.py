"""The attention seam: one attention entry point for every model family meshlm runs, with backends.

mlx-lm's attention layers (llama, mistral, qwen2, qwen3) rotate q and k with
`cache.offset`, call `cache.update_and_fetch(k, v)`, then their module's
`scaled_dot_product_attention(..., cache=cache, ...)`. meshlm hands each layer
a `LayerKV` as its cache: its offset carries every token's true position, its
update writes the step's K and V into this rank's block pools, and the
module's attention function (rebound once, settings-free, by model/adapt.py)
sends the call back to `LayerKV.attend`. So the engine's settings live on
objects, not on module globals: two engines with different backends can share
a process.

Backends (`attention_backend` picks one per engine):
- `CPUBackend`: meshlm's base-2 kernels (model/cpu_kernels.py); with the
  compiled `_cpu_ops`, a decode row's keys and values are read from the pool's
  blocks in place by one primitive per layer.
- `PortableBackend`: MLX only, for Metal/CUDA (and CPU without meshlm's
  kernels): a row's blocks are gathered into one contiguous copy and
  `mx.fast.scaled_dot_product_attention` runs on it. Per step it reads exactly
  the KV the rows need, plus that one copy (docs/ARCHITECTURE.md).
- `attend_exact` (any backend, on request): masked attention by true
  positions that also returns each query's log-sum-exp, so partial attentions
  over disjoint key sets merge exactly (`merge_partials`): what a rank holding
  a subset of a sequence's positions, or ring attention, needs.
"""

from __future__ import annotations

import math
from typing import Protocol

import mlx.core as mx

from meshlm.model import cpu_kernels
from meshlm.model.batch import Batch, DecodeRows, ExtendGroup, ExtendRow, row_slots

LOG2E = 1.4426950408889634
SPLIT_DECODE_ROWS = 8  # decode batches this large run half their attention on a second CPU stream


class AttentionBackend(Protocol):
    name: str
    groups_extend_rows: bool  # several short prompts attend in one padded call (Batch.build groups them)
    partial_counts: bool  # `partial` given counts is one call for any number of queries (no blocks needed)

    def decode(self, q: mx.array, pool_k: mx.array, pool_v: mx.array, rows: DecodeRows, block_size: int,
               scale: float) -> mx.array:
        """q (R, H, D): one new token per row, against its blocks. Returns (R, H, D)."""
        ...

    def extend(self, q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """q (n, H, D) are the last n of the S positions in keys/values (Hk, S, D); causal. (n, H, D)."""
        ...

    def extend_paged(self, q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, scale: float) -> mx.array:
        """`extend` against the pools' rows at `slots` (S,), the row's every position in order. (n, H, D)."""
        ...

    def extend_group(self, q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
        """Padded rows: q (B, H, L, D), keys/values (B, Hk, S, D), mask (B, 1, L, S). (B, H, L, D)."""
        ...

    def partial(self, q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None,
                scale: float, counts: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Attention over some of the keys, for merging (`merge_partials`): q (n, H, D), keys/values
        (Hk, S, D), S >= 1, mask (n, S) bool or None. Returns (n, H, D) and each query's natural
        log-sum-exp (n, H). `counts` (n,), where given: query i sees exactly the first counts[i] keys,
        the mask's meaning (a causal mask over position-sorted keys is such a prefix)."""
        ...

    def partial_paged(self, q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, scale: float,
                      counts: mx.array) -> tuple[mx.array, mx.array]:
        """`partial` with counts against the pools' rows at `slots` (S,), read in place where it can."""
        ...

    def decode_partial(self, q: mx.array, pool_k: mx.array, pool_v: mx.array, tables: mx.array,
                       lengths: mx.array, block_size: int, scale: float) -> tuple[mx.array, mx.array]:
        """One query per row against the first lengths[i] slots of its blocks (tables (R, max_blocks)),
        in place in the pools, for merging: q (R, H, D). Returns (R, H, D) and each query's natural
        log-sum-exp (R, H); a row of no keys gets zeros and -inf."""
        ...


def attend_exact(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                 mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """q (n, H, D), keys/values (Hk, S, D), mask (n, S) bool or None. Returns the output (n, H, D) and
    each query's natural log-sum-exp of its scores (n, H); a query whose keys are all masked (or S = 0)
    gets zeros and -inf, which merges as "no contribution"."""
    n, H, D = q.shape
    Hk = keys.shape[0]
    r = H // Hk
    qg = q.astype(mx.float32).reshape(n, Hk, r, D).transpose(1, 2, 0, 3)  # (Hk, r, n, D)
    scores = (qg * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)[:, None]  # (Hk, r, n, S)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    out, lse = _softmax_partial(scores, values.astype(mx.float32)[:, None])
    out = out.transpose(2, 0, 1, 3).reshape(n, H, D).astype(q.dtype)
    return out, lse.transpose(2, 0, 1).reshape(n, H)


def _softmax_partial(scores: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """Softmax of scores (..., n, S), -inf where masked, times values (..., S, D): the output (..., n, D)
    and the natural log-sum-exp (..., n); zeros and -inf for a query with no key."""
    peak = mx.max(scores, axis=-1, keepdims=True)
    safe = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(scores - safe)
    total = weights.sum(axis=-1, keepdims=True)
    out = (weights @ values) / mx.maximum(total, 1e-30)
    lse = mx.where(total > 0, mx.log(mx.maximum(total, 1e-30)) + safe, -mx.inf)
    return out, lse[..., 0]


def paged_partial(q: mx.array, pool_k: mx.array, pool_v: mx.array, tables: mx.array, lengths: mx.array,
                  block_size: int, scale: float) -> tuple[mx.array, mx.array]:
    """`AttentionBackend.decode_partial` in MLX ops, a row at a time over exactly its keys (as `decode`).
    One padded gather of every row read R x the longest row's keys (GBs for one long row among many
    short ones) and slots past each row's end, where another sequence's inf or NaN made the row's zero
    weights NaN."""
    _, H, D = q.shape
    outs, lses = [], []
    for i, n in enumerate(lengths.tolist()):  # the plan's lengths, made on the host: no sync of the step
        if n <= 0:  # this rank holds none of the row's keys: no contribution
            outs.append(mx.zeros((1, H, D), dtype=q.dtype))
            lses.append(mx.full((1, H), -mx.inf, dtype=mx.float32))
            continue
        slots = row_slots(tables[i], n, block_size)
        out, lse = attend_exact(q[i:i + 1], _gather(pool_k, slots), _gather(pool_v, slots), scale)
        outs.append(out)
        lses.append(lse)
    return mx.concatenate(outs), mx.concatenate(lses)


def merge_partials(parts: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """Combine attentions of the same queries over disjoint key sets: ((n, H, D), (n, H)) each."""
    lses = mx.stack([lse for _, lse in parts])  # (P, n, H)
    peak = mx.max(lses, axis=0)
    safe = mx.where(mx.isinf(peak), 0.0, peak)
    w = mx.exp(lses - safe)  # (P, n, H); 0 for a part with no keys
    total = w.sum(axis=0)
    out = sum(o.astype(mx.float32) * w[i][..., None] for i, (o, _) in enumerate(parts))
    out = out / mx.maximum(total, 1e-30)[..., None]
    lse = mx.where(total > 0, mx.log(mx.maximum(total, 1e-30)) + safe, -mx.inf)
    return out.astype(parts[0][0].dtype), lse


def _gather(pool: mx.array, slots: mx.array) -> mx.array:
    """The (kv_heads, len(slots), head_dim) view of a token-major pool's rows (one copy: the gather)."""
    return mx.take(pool, slots, axis=0).transpose(1, 0, 2)


class PortableBackend:
    """MLX only: gather each row's blocks once, then the fused SDPA kernel."""

    name = "portable (gather + mx.fast.scaled_dot_product_attention)"
    groups_extend_rows = True  # a row's gather and SDPA are several MLX ops: fewer calls for many short rows
    partial_counts = False  # its partial builds (queries, keys) masks: blocks keep them small

    def decode(self, q, pool_k, pool_v, rows, block_size, scale):
        outs = []
        for i, slots in enumerate(rows.slots()):
            k, v = _gather(pool_k, slots)[None], _gather(pool_v, slots)[None]
            qi = q[i][None, :, None]  # (1, H, 1, D)
            outs.append(mx.fast.scaled_dot_product_attention(qi, k, v, scale=scale)[0, :, 0])
        return mx.stack(outs)

    def extend(self, q, keys, values, scale):
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys[None], values[None],
                                                   scale=scale, mask="causal")
        return out.squeeze(0).transpose(1, 0, 2)

    def extend_paged(self, q, pool_k, pool_v, slots, scale):
        return self.extend(q, _gather(pool_k, slots), _gather(pool_v, slots), scale)

    def extend_group(self, q, keys, values, mask, scale):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)

    def partial(self, q, keys, values, mask, scale, counts=None):
        return attend_exact(q, keys, values, scale, mask)

    def partial_paged(self, q, pool_k, pool_v, slots, scale, counts):
        mask = mx.arange(slots.shape[0])[None] < counts[:, None]
        return self.partial(q, _gather(pool_k, slots), _gather(pool_v, slots), mask, scale, counts)

    def decode_partial(self, q, pool_k, pool_v, tables, lengths, block_size, scale):
        return paged_partial(q, pool_k, pool_v, tables, lengths, block_size, scale)


class CPUBackend:
    """meshlm's CPU kernels; `native` is the compiled `_cpu_ops` module or None (MLX ops only)."""

    def __init__(self, native=None, cores: int = 1) -> None:
        self.native = native
        self._causal = native.causal_attention if native is not None and native.packed_gemm else None
        self._partial = native.causal_partial if self._causal is not None else None
        # `partial` with counts runs one call for any number of queries (ring_attention.attend_blocks)
        self.partial_counts = self._partial is not None
        # With the compiled causal attention each row is one node that computes only what it sees: 16
        # prompts of ~260 tokens prefilled 12 % faster on the 72M llama (one core) and ~30 % on the demo
        # model (two threads) row by row than in padded groups of MLX ops, and 16 of 4-43 tokens ~7 %.
        self.groups_extend_rows = self._causal is None
        self.split = cores >= 2  # a second stream for big decode batches: only with a core to spare
        self._stream: mx.Stream | None = None
        self.name = "CPU kernels" + (" (compiled, paged decode)" if native is not None else " (MLX ops)")

    def decode(self, q, pool_k, pool_v, rows, block_size, scale):
        if q.dtype != mx.float32:
            return PortableBackend.decode(self, q, pool_k, pool_v, rows, block_size, scale)
        R = q.shape[0]
        if self.split and self.native is None and R >= SPLIT_DECODE_ROWS:  # the kernel shares its own rows
            h = R // 2
            first = self._decode(q[:h], pool_k, pool_v, rows, 0, h, block_size, scale)
            with mx.stream(self._second()):
                second = self._decode(q[h:], pool_k, pool_v, rows, h, R, block_size, scale)
            return mx.concatenate([first, second], axis=0)
        return self._decode(q, pool_k, pool_v, rows, 0, R, block_size, scale)

    def _second(self) -> mx.Stream:
        if self._stream is None:
            self._stream = mx.new_stream(mx.cpu)
        return self._stream

    def _decode(self, q, pool_k, pool_v, rows: DecodeRows, a: int, b: int, block_size: int,
                scale: float) -> mx.array:
        """q (b - a, H, D): rows a..b. The compiled kernel scales q itself (one graph node less per layer)."""
        if self.native is not None:
            return self.native.paged_decode_attention(q, pool_k, pool_v, rows.tables[a:b], rows.lengths[a:b],
                                                      block_size, scale * LOG2E)
        R, H, D = q.shape
        qs = (q * (scale * LOG2E)).reshape(R, pool_k.shape[1], -1, D)
        slots = rows.slots(a, b)
        width = max(int(s.shape[0]) for s in slots)
        idx = mx.stack([mx.pad(s, (0, width - int(s.shape[0]))) for s in slots])  # (R, S), padded with slot 0
        R, Hk, r, D = qs.shape
        k = mx.take(pool_k, idx.reshape(-1), axis=0).reshape(R, width, Hk, D).transpose(0, 2, 1, 3)
        v = mx.take(pool_v, idx.reshape(-1), axis=0).reshape(R, width, Hk, D).transpose(0, 2, 1, 3)
        mask = (mx.arange(width)[None] < rows.lengths[a:b, None]).reshape(R, 1, 1, 1, width)
        return cpu_kernels.attend(qs.reshape(R, Hk, r, 1, D), k, v, mask)[:, :, :, 0].reshape(R, Hk * r, D)

    def extend(self, q, keys, values, scale):
        if q.dtype != mx.float32:
            return PortableBackend.extend(self, q, keys, values, scale)
        if self._causal is not None:
            # The keys and values are (Hk, S, D) views of token-major rows: the kernel reads them in place.
            return self._causal(q, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), scale * LOG2E)
        out = cpu_kernels.attention(q.transpose(1, 0, 2)[None], keys[None], values[None], scale, self.native)
        return out.squeeze(0).transpose(1, 0, 2)

    def extend_paged(self, q, pool_k, pool_v, slots, scale):
        if q.dtype == mx.float32 and self._causal is not None:
            return self.native.causal_attention_paged(q, pool_k, pool_v, slots, scale * LOG2E)
        return PortableBackend.extend_paged(self, q, pool_k, pool_v, slots, scale)

    def extend_group(self, q, keys, values, mask, scale):
        if q.dtype != mx.float32:
            return PortableBackend.extend_group(self, q, keys, values, mask, scale)
        return cpu_kernels.attention(q, keys, values, scale, self.native, mask)

    def partial(self, q, keys, values, mask, scale, counts=None):
        if q.dtype != mx.float32 or self.native is None:
            return PortableBackend.partial(self, q, keys, values, mask, scale)
        if counts is not None and self._partial is not None and q.shape[0] > 1:
            # The compiled kernel, as a prompt chunk's (`extend`): CP=2's 32K-token prefill took 4.99 s
            # through the MLX ops below, 2.09-2.13 s with it (one process 3.6-3.9 s). Not for one query
            # (a decode row): the kernel packs all of its keys per call, and CP=2's ITL after that prompt
            # went 8.4 -> 10.6 ms with it, 7.5 without (docs/BENCHMARKS.md).
            out, lse = self._partial(q, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), counts,
                                     scale * LOG2E)
            return out, lse
        return cpu_kernels.partial_attention(q, keys, values, mask, scale, self.native)

    def partial_paged(self, q, pool_k, pool_v, slots, scale, counts):
        if q.dtype == mx.float32 and self._partial is not None and q.shape[0] > 1:
            return self.native.causal_partial_paged(q, pool_k, pool_v, slots, counts, scale * LOG2E)
        return PortableBackend.partial_paged(self, q, pool_k, pool_v, slots, scale, counts)

    def decode_partial(self, q, pool_k, pool_v, tables, lengths, block_size, scale):
        if q.dtype != mx.float32 or self.native is None:
            return paged_partial(q, pool_k, pool_v, tables, lengths, block_size, scale)
        # In place in the pools, as one process's decode: a CP rank's decode rows gathered each row's
        # keys and values twice (its slots, then head-major) before attending them with MLX ops.
        out, lse = self.native.paged_decode_partial(q, pool_k, pool_v, tables, lengths, block_size, scale * LOG2E)
        return out, lse


def attention_backend(device_is_cpu: bool, cpu_kernels_on: bool, native=None, cores: int = 1) -> AttentionBackend:
    """The backend for one engine's settings (ModelConfig.cpu_kernels / native_kernels)."""
    if device_is_cpu and cpu_kernels_on:
        return CPUBackend(native, cores)
    return PortableBackend()


def attend_batch(q: mx.array, pool_k: mx.array, pool_v: mx.array, batch: Batch, backend: AttentionBackend,
                 scale: float, block_size: int, new_k: mx.array | None, new_v: mx.array | None) -> mx.array:
    """Attention of every token of a step: q (T, H, D); the step's own keys and values new_k/new_v
    (T, Hk, D), also written into the pools. Returns (T, H, D). Fresh prompts attend to the step's
    own keys; rows continuing earlier positions read theirs from the pools."""
    parts = []
    if batch.decode is not None:
        d = batch.decode.count
        parts.append(backend.decode(q[:d], pool_k, pool_v, batch.decode, block_size, scale))
    for item in batch.extend:
        if isinstance(item, ExtendGroup):
            src = (new_k, new_v) if item.fresh else (pool_k, pool_v)
            parts.append(_extend_group(q, *src, item, backend, scale))
        else:
            parts.append(_extend(q[item.first : item.first + item.count], pool_k, pool_v, new_k, new_v, item,
                                 backend, scale))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _extend_group(q: mx.array, src_k, src_v, g: ExtendGroup, backend: AttentionBackend, scale: float) -> mx.array:
    """`src_k`/`src_v` token-major (the pools, or the step's own K and V for fresh rows)."""
    H, D = q.shape[1], q.shape[2]
    Hk = src_k.shape[1]
    if g.dense:  # equal fresh rows: reshapes, no gathers
        qg = q[g.first : g.first + g.count].reshape(g.rows, g.width, H, D)
        keys = src_k[g.first : g.first + g.count].reshape(g.rows, g.span, Hk, D)
        values = src_v[g.first : g.first + g.count].reshape(g.rows, g.span, Hk, D)
    else:
        qg = mx.take(q, g.q_index, axis=0).reshape(g.rows, g.width, H, D)
        keys = mx.take(src_k, g.kv_index, axis=0).reshape(g.rows, g.span, Hk, D)
        values = mx.take(src_v, g.kv_index, axis=0).reshape(g.rows, g.span, Hk, D)
    t = (0, 2, 1, 3)
    out = backend.extend_group(qg.transpose(t), keys.transpose(t), values.transpose(t), g.mask, scale)
    out = out.transpose(t).reshape(g.rows * g.width, H, D)
    return out if g.dense else mx.take(out, g.out_index, axis=0)


def _extend(q: mx.array, pool_k, pool_v, new_k, new_v, row: ExtendRow, backend: AttentionBackend,
            scale: float) -> mx.array:
    if row.kv_slots is None:  # a fresh row: its keys are exactly this step's
        a, b = row.first, row.first + row.count
        keys, values = new_k[a:b].transpose(1, 0, 2), new_v[a:b].transpose(1, 0, 2)
    elif row.q_positions is None:  # a prompt's next chunk: its context in place in the pools
        return backend.extend_paged(q, pool_k, pool_v, row.kv_slots, scale)
    else:
        keys, values = _gather(pool_k, row.kv_slots), _gather(pool_v, row.kv_slots)
    if row.q_positions is None:
        return backend.extend(q, keys, values, scale)
    mask = row.k_positions[None] <= row.q_positions[:, None]
    return attend_exact(q, keys, values, scale, mask)[0]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# -- the seam: how mlx-lm's layers reach the code above ------------------------------------------------


class TokenPositions:
    """A cache's `offset` in meshlm's batches: every token's own position (model/adapt.py's TokenRoPE)."""

    __slots__ = ("positions",)

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions


class LayerKV:
    """The cache meshlm hands one mlx-lm attention layer for one step: where the step's K and V go,
    and how the step's attention is computed."""

    def __init__(self, store, layer: int, batch: Batch, backend: AttentionBackend) -> None:
        self.store, self.layer, self.batch, self.backend = store, layer, batch, backend
        self.offset = TokenPositions(batch.positions)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's K and V (1, Hk, T, D) into the pools (and keep them for `attend`)."""
        self.step_k, self.step_v = keys, values
        self.store.write(self.layer, self.batch.slots, keys, values)
        return keys, values

    def make_mask(self, *args, **kwargs) -> None:
        return None  # the batch knows each row's keys; no dense mask is built

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        # squeeze, not [0]: MLX builds an int index as a gather and a squeeze, and every graph node costs the
        # thread that builds and schedules the step (a decode step is ~1,000 of them).
        q = queries.squeeze(0).transpose(1, 0, 2)  # (T, H, D): the token-major layout the projections produced
        new_k = new_v = None  # (T, Hk, D): only fresh prompt rows read the step's own keys, so only they build them
        if self.batch.extend:
            new_k, new_v = self.step_k.squeeze(0).transpose(1, 0, 2), self.step_v.squeeze(0).transpose(1, 0, 2)
        out = attend_batch(q, self.store.keys[self.layer], self.store.values[self.layer], self.batch,
                           self.backend, scale, self.store.block_size, new_k, new_v)
        return out.transpose(1, 0, 2)[None]


def install_seam(module) -> None:
    """Route `module.scaled_dot_product_attention` calls with a LayerKV cache to meshlm (idempotent).

    The replacement holds no settings: which backend runs is the cache's, so
    every model of that family in the process keeps its own."""
    original = module.scaled_dot_product_attention
    if getattr(original, "meshlm_seam", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, LayerKV):
            return cache.attend(queries, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.meshlm_seam = True
    module.scaled_dot_product_attention = scaled_dot_product_attention
