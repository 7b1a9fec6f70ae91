"""One step's tokens, flattened: every row's new tokens side by side, with positions, KV slots and the
rows' block tables, built once per step and shared by every layer.

Rows are sequences with new tokens this step: decode rows (one token) come
first, then extend rows (prefill chunks, speculative verification: several
tokens after `start` tokens already in KV). There is no padding: a step's
forward runs exactly its tokens through every matrix, decode and prefill in
the same pass over the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE


@dataclass(frozen=True)
class RowSpec:
    """What the runner knows of one row before building the batch."""

    uid: int
    start: int  # positions already in KV before this step's tokens
    token_ids: tuple[int, ...]
    blocks: tuple[int, ...]  # the row's block table, covering start + len(token_ids) positions
    logits: int = LOGITS_LAST
    positions: tuple[int, ...] | None = None  # true positions of the new tokens (None: start, start+1, ...)
    kv_positions: tuple[int, ...] | None = None  # of all start + len(token_ids) positions held (None: 0, 1, ...)
    holder: int = -1  # context parallelism: the rank holding the whole row (-1: split over every rank)


@dataclass
class ExtendRow:
    first: int  # index of its first token in the flattened batch
    count: int
    start: int  # positions in KV before these tokens
    kv_slots: mx.array | None  # (start + count,) pool slots of every position it attends to, in order;
    # None for a fresh row (start 0): its keys are this step's own, read before they reach the pool
    q_positions: mx.array | None = None  # set when the row holds a subset of a sequence's positions:
    k_positions: mx.array | None = None  # the causal mask then compares true positions


@dataclass
class ExtendGroup:
    """Several extend rows attending in one padded call: their queries padded to `width`, their keys
    to `span` (MLX's CPU ops cost ~30 us each, so per-row attention of sixteen short prompts cost more
    than the attention itself). Only attention is padded; every matrix still sees the exact tokens."""

    first: int  # the rows' tokens are batch tokens [first, first + count), row after row
    count: int
    rows: int
    width: int
    span: int
    q_index: mx.array  # (rows * width,) batch token index of each padded query (padding: `first`)
    kv_index: mx.array  # (rows * span,) each padded key: a pool slot, or for fresh rows a batch token index
    fresh: bool  # every row starts at 0: its keys are this step's own (no read of the pool after the write)
    dense: bool  # fresh rows of one length: nothing to pad, the gathers are plain reshapes
    mask: mx.array  # (rows, 1, width, span) bool: causal within each row, padding masked
    out_index: mx.array  # (count,) where each real token's output sits among the rows * width


@dataclass
class DecodeRows:
    count: int  # the first `count` tokens of the batch
    tables: mx.array  # (count, max_blocks) int32, padded with block 0
    lengths: mx.array  # (count,) int32: keys per row, its new token included
    rows: list[RowSpec]
    block_size: int

    def slots(self, a: int = 0, b: int | None = None) -> list[mx.array]:
        """Rows [a, b)'s pool slots, for the gather paths (the paged kernel reads the tables instead)."""
        return [row_slots(r.blocks, r.start + 1, self.block_size) for r in self.rows[a:b]]


@dataclass
class Batch:
    rows: list[RowSpec]  # decode rows first, in batch order
    tokens: mx.array  # (T,) int32
    positions: mx.array  # (T,) int32, what RoPE rotates by
    slots: mx.array  # (T,) int32, where each token's K and V are written
    decode: DecodeRows | None
    extend: list[ExtendRow | ExtendGroup]  # in batch token order, after the decode rows
    logit_rows: list[int]  # uid per row of the logits, in order
    logit_index: mx.array  # (rows of logits,) token indices whose hidden state gets the LM head

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def build(cls, rows: list[RowSpec], block_size: int, group: bool = True) -> "Batch":
        """`group`: extend rows may share padded attention calls (the backend's `groups_extend_rows`); the
        tokens' order is the same either way, so stages of a pipeline agree on their activations."""
        rows = _split_short_rows(rows)
        groups = _group_extend_rows([r for r in rows if len(r.token_ids) != 1], PAD_FACTOR if group else 0.0)
        rows = [r for r in rows if len(r.token_ids) == 1] + [r for g in groups for r in g]
        tokens, positions, slots, logit_index, logit_rows = [], [], [], [], []
        for r in rows:
            first = len(tokens)
            pos = r.positions or range(r.start, r.start + len(r.token_ids))
            tokens.extend(r.token_ids)
            positions.extend(pos)
            slots.extend(_slot(r.blocks, r.start + i, block_size) for i in range(len(r.token_ids)))
            want = {LOGITS_NONE: [], LOGITS_LAST: [len(r.token_ids) - 1],
                    LOGITS_ALL: range(len(r.token_ids))}[r.logits]
            logit_index.extend(first + i for i in want)
            logit_rows.extend([r.uid] * len(want))
        n_decode = sum(1 for r in rows if len(r.token_ids) == 1)
        return cls(rows, mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                   mx.array(slots, dtype=mx.int32), _decode_rows(rows[:n_decode], block_size),
                   _extend(groups, n_decode, block_size), logit_rows, mx.array(logit_index, dtype=mx.int32))


SPLIT_MAX_TOKENS = 16  # a row continuing its KV with this few tokens may attend as that many decode rows:
SPLIT_ALWAYS_TOKENS = 4  # always up to this many, more only while tokens x positions before them stay within
SPLIT_MAX_PAIRS = 40_000  # this: each decode row reads the whole context, where the paged causal kernel reads it
# once; one core, the 72M llama's heads, a layer: 16 tokens at 18,000 positions 114 ms as decode rows against 52,
# 8 at 8,000 12.0 against 9.7, but 12 at 1,000 0.61 against 0.62 and 4 at 18,000 26.8 against 26.7.


def _split_short_rows(rows: list[RowSpec]) -> list[RowSpec]:
    """A few tokens after a cached prefix (a speculative verify chunk, the tail of a chunked prefill) as
    one decode row per token: token i attends to the first start + i + 1 positions, which is exactly
    the causal mask, and the paged decode kernel reads them in place where the extend path would
    gather the whole prefix into a copy first (measured: a 2-token verify of the demo model cost 13 ms
    more than a 1-token decode, 30 % of a step). The matrices still see the tokens together."""
    out = []
    for r in rows:
        n = len(r.token_ids)
        short = n <= SPLIT_ALWAYS_TOKENS or n * r.start <= SPLIT_MAX_PAIRS
        if (not 1 < n <= SPLIT_MAX_TOKENS or not short or r.start == 0 or r.positions is not None
                or r.kv_positions is not None):
            out.append(r)
            continue
        for i, token in enumerate(r.token_ids):
            wanted = r.logits == LOGITS_ALL or (r.logits == LOGITS_LAST and i == n - 1)
            out.append(RowSpec(r.uid, r.start + i, (token,), r.blocks, LOGITS_LAST if wanted else LOGITS_NONE))
    return out


def _slot(blocks: tuple[int, ...], position: int, block_size: int) -> int:
    return blocks[position // block_size] * block_size + position % block_size


def row_slots(blocks: "tuple[int, ...] | mx.array", length: int, block_size: int) -> mx.array:
    """Pool slots of a row's first `length` positions, computed on the device (long rows are cheap);
    `blocks` its table, or a row of a padded one (`block_tables`)."""
    table = mx.array(blocks[: -(-length // block_size)], dtype=mx.int32)
    return (table[:, None] * block_size + mx.arange(block_size, dtype=mx.int32)[None]).reshape(-1)[:length]


def block_tables(tables: list[tuple[int, ...]], lengths: list[int], block_size: int) -> mx.array:
    """(rows, max_blocks) int32: each row's blocks holding its first lengths[i] slots, padded with block 0
    (at least one column: a row of no keys reads none)."""
    used = [-(-n // block_size) for n in lengths]
    width = max(1, max(used, default=0))
    return mx.array([list(t[:u]) + [0] * (width - u) for t, u in zip(tables, used)], dtype=mx.int32)


def _decode_rows(rows: list[RowSpec], block_size: int) -> DecodeRows | None:
    if not rows:
        return None
    lengths = [r.start + 1 for r in rows]
    return DecodeRows(len(rows), block_tables([r.blocks for r in rows], lengths, block_size),
                      mx.array(lengths, dtype=mx.int32), rows, block_size)


PAD_FACTOR = 1.5  # padded attention work a group may take, relative to what its rows need


def _group_extend_rows(rows: list[RowSpec], pad_factor: float) -> list[list[RowSpec]]:
    """Extend rows in groups whose padded attention (rows x longest chunk x longest context) stays
    within `pad_factor` of the work their rows need (0: every row alone). Fresh rows (start 0) and rows
    continuing a prefix are never mixed; rows holding a subset of positions stay alone."""
    groups: list[list[RowSpec]] = []
    for r in sorted(rows, key=lambda r: (r.start == 0, r.start + len(r.token_ids), len(r.token_ids)), reverse=True):
        g = groups[-1] if groups and _groupable(groups[-1][0], r) else None
        if g is not None and _padded(g + [r]) <= pad_factor * sum(_work(x) for x in g + [r]):
            g.append(r)
        else:
            groups.append([r])
    return groups


def _groupable(a: RowSpec, b: RowSpec) -> bool:
    return a.kv_positions is None and b.kv_positions is None and (a.start == 0) == (b.start == 0)


def _work(r: RowSpec) -> int:
    return len(r.token_ids) * (r.start + len(r.token_ids))


def _padded(rows: list[RowSpec]) -> int:
    return len(rows) * max(len(r.token_ids) for r in rows) * max(r.start + len(r.token_ids) for r in rows)


def _extend(groups: list[list[RowSpec]], first: int, block_size: int) -> list[ExtendRow | ExtendGroup]:
    out: list[ExtendRow | ExtendGroup] = []
    for g in groups:
        count = sum(len(r.token_ids) for r in g)
        out.append(_extend_row(g[0], first, block_size) if len(g) == 1 else _extend_group(g, first, block_size))
        first += count
    return out


def _extend_row(r: RowSpec, first: int, block_size: int) -> ExtendRow:
    n = len(r.token_ids)
    fresh = r.start == 0 and r.kv_positions is None
    row = ExtendRow(first, n, r.start, None if fresh else row_slots(r.blocks, r.start + n, block_size))
    if r.kv_positions is not None:
        row.q_positions = mx.array(r.positions or r.kv_positions[r.start :], dtype=mx.int32)
        row.k_positions = mx.array(r.kv_positions, dtype=mx.int32)
    return row


def _extend_group(rows: list[RowSpec], first: int, block_size: int) -> ExtendGroup:
    width = max(len(r.token_ids) for r in rows)
    span = max(r.start + len(r.token_ids) for r in rows)
    fresh = rows[0].start == 0  # groups are all fresh or all continuing (see _groupable)
    q_index, out_index, slots, t = [], [], [], first
    for b, r in enumerate(rows):
        n = len(r.token_ids)
        q_index += list(range(t, t + n)) + [first] * (width - n)
        out_index += range(b * width, b * width + n)
        if not fresh:
            slots.append(mx.pad(row_slots(r.blocks, r.start + n, block_size), (0, span - r.start - n)))
        t += n
    starts = mx.array([r.start for r in rows], dtype=mx.int32)[:, None, None]
    ends = mx.array([r.start + len(r.token_ids) for r in rows], dtype=mx.int32)[:, None, None]
    q, k = mx.arange(width, dtype=mx.int32)[None, :, None], mx.arange(span, dtype=mx.int32)[None, None, :]
    mask = ((k <= starts + q) & (k < ends))[:, None]
    q = mx.array(q_index, dtype=mx.int32)
    kv = q if fresh else mx.concatenate(slots)  # fresh: width == span, the keys are the queries' tokens
    dense = fresh and all(len(r.token_ids) == width for r in rows)
    return ExtendGroup(first, t - first, len(rows), width, span, q, kv, fresh, dense, mask,
                       mx.array(out_index, dtype=mx.int32))
