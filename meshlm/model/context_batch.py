"""One context-parallel step as one rank sees it: its share of every row's new tokens, and the index
arithmetic of both ring algorithms, computed once per step from the plan alone.

Every rank builds the same picture of every rank's share (the split is a
function of positions, docs/CONTEXT_PARALLEL.md), so the collectives of a
step line up without a word exchanged about shapes:
- each rank runs `width` tokens through the matrices (its own, then padding:
  the widest rank's count), so gathered queries and outputs have one shape;
- pass-Q: queries of every rank, gathered rank after rank (`width` each),
  attend to this rank's KV row by row; the partial outputs return to their
  owners and merge by log-sum-exp;
- pass-KV: every rank's KV of the step's rows (cached and new), gathered
  rank after rank (`kv_width` each); this rank's queries attend to its own
  KV while the gather runs, then to the other ranks', and the two partials
  merge by log-sum-exp;
- logits: the rank holding a wanted position contributes its hidden state,
  the others zeros, and one sum gives every rank every wanted row;
- replicated (decode steps): every rank runs every row's one new token, so
  only the partial outputs are gathered, and every rank has every row
  (`ContextBatch.replicated`).

A row kept whole on one rank (`--cp-min-tokens`, kv/context_blocks.py) is a
row whose every position that rank holds (`WholeRow`), so both algorithms
carry it unchanged; a step of whole rows only runs `local`: each rank runs
its own rows' tokens alone (no padding) and attends them to its own pools,
with no collective but the one that brings the logits to rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE
from meshlm.kv.context_split import ContextSplit, row_split
from meshlm.model.batch import RowSpec, block_tables, row_slots

PASS_KV, PASS_Q, LOCAL, REPLICATED = "pass-kv", "pass-q", "local", "replicated"
# The seed's second rule (pass-KV when the step has enough new tokens for their attention to hide the
# KV transfer) is off: measured 2026-11-24 (benchmarks/context_parallel.py, CP=2 on one core per rank,
# 1,024-token chunks of a 16K-token prompt), pass-Q was 1.11-1.22x faster at every cached fraction from
# 0 to 0.97, and a first chunk with nothing cached cost the same either way: no new-token count picks
# pass-KV profitably on this machine.
MIN_NEW_FOR_KV = 1 << 30


QUERY_BLOCK = 128  # queries per attention call: each block reads only the keys up to its last position


@dataclass
class QueryBlock:
    """Queries [start, stop) of a row's position-sorted queries, against its first `visible` keys;
    `mask` (stop - start, visible) where some of those keys are later than some of the queries."""

    start: int
    stop: int
    visible: int
    mask: mx.array | None
    counts: mx.array | None = None  # (stop - start,) int32: keys each query sees, a prefix (the mask's rows)


@dataclass
class RingRow:
    """What this rank computes for one sequence of the step (one algorithm's fields are filled)."""

    uid: int
    own: slice  # this rank's new tokens of the row among its `width` batch tokens
    q_index: mx.array | None = None  # pass-Q: the row's queries among the gathered ones, by position
    kv_slots: mx.array | None = None  # this rank's pool slots of the row, below its end
    kv_index: mx.array | None = None  # pass-KV: the other ranks' keys of the row among the gathered ones
    blocks: tuple[QueryBlock, ...] = ()  # the row's queries against kv_slots (pass-Q, local) or kv_index
    own_blocks: tuple[QueryBlock, ...] = ()  # pass-KV: this rank's queries against its own kv_slots
    paged: bool = False  # pass-Q, local: one query (a decode row), attended in the step's PagedRows


@dataclass
class PagedRows:
    """The step's rows of one query (decode rows) under pass-Q or local: each query sees a prefix of this
    rank's KV of its row, which `AttentionBackend.decode_partial` reads in place in the pools, every such
    row in one call a layer (as one process's decode), instead of each row's keys gathered twice."""

    q_index: mx.array  # (R,) each row's query among the gathered ones (pass-Q) or this rank's own (local)
    tables: mx.array  # (R, max_blocks) int32: the rows' blocks in this rank's pools, padded with block 0
    lengths: mx.array  # (R,) int32: the keys of its row, on this rank, each query sees


def query_blocks(q_positions: np.ndarray, k_positions: np.ndarray) -> tuple[QueryBlock, ...]:
    """Causal blocks over ascending query and key positions: a block skips the keys after its last
    query and needs no mask when every key it reads precedes its first query."""
    out = []
    keys = None
    for a in range(0, len(q_positions), QUERY_BLOCK):
        b = min(len(q_positions), a + QUERY_BLOCK)
        visible = int(np.searchsorted(k_positions, q_positions[b - 1], "right"))
        mask = None
        if visible and k_positions[visible - 1] > q_positions[a]:
            keys = mx.array(k_positions.astype(np.int32)) if keys is None else keys
            mask = keys[:visible][None] <= mx.array(q_positions[a:b].astype(np.int32))[:, None]
        counts = np.searchsorted(k_positions, q_positions[a:b], "right").astype(np.int32)
        out.append(QueryBlock(a, b, visible, mask, mx.array(counts)))
    return tuple(out)


@dataclass
class ContextBatch:
    split: ContextSplit
    algorithm: str  # PASS_KV, PASS_Q or LOCAL, the same on every rank
    width: int  # tokens this rank runs this step (the widest share, padded, except with LOCAL: its own)
    count: int  # this rank's own tokens (the first `count` of `width`)
    tokens: mx.array  # (width,) int32
    positions: mx.array  # (width,) int32, true positions (padding: 0)
    slots: mx.array  # (count,) int32, where this rank's new K and V go
    rows: list[RingRow]
    q_order: mx.array  # pass-Q: (ranks * width,) where each gathered query's partial sits among the rows'
    kv_local: mx.array  # pass-KV: (kv_width,) this rank's slots to send, padded with its first slot
    kv_width: int
    logit_rows: list[int]  # uid per wanted row of logits, in order
    logit_index: mx.array  # (rows of logits,) index among this rank's tokens (0 when another holds it)
    logit_mine: mx.array  # (rows of logits,) 1.0 where this rank holds the wanted position, else 0.0
    paged: PagedRows | None = None  # pass-Q, local: the rows of one query
    # local with paged rows: (count,) where each own token's output sits in [the other rows' outputs, in
    # row order; the paged rows']
    out_order: mx.array | None = None
    write_index: mx.array | None = None  # replicated: (count,) this rank's own tokens among the `width`

    @classmethod
    def replicated(cls, rows: list[RowSpec], split: ContextSplit) -> "ContextBatch":
        """A step of one new token a row (decode): every rank runs every row's token through the matrices
        (the other ranks' padding ran them anyway) and attends all of them to its own KV; one gather of the
        partials a layer then leaves every rank with every row's output, where pass-Q gathers the queries
        too, and no sum brings the logits to rank 0. Only a token's holder writes its K and V."""
        slots, own, paged, out_rows, logit_rows, logit_index = [], [], [], [], [], []
        for i, r in enumerate(rows):
            sp = row_split(split, r.holder)
            mine = sp.held(r.start, r.start + 1)  # the row's one new position, if this rank holds it
            if mine.size:
                own.append(i)
                slots.extend(sp.slots(r.blocks, mine).tolist())
            # The row's last position: it sees every key this rank holds (counted, not listed: at 1M
            # positions the list took 69 ms a row)
            paged.append((i, r.blocks, sp.local_count(r.start + 1)))
            out_rows.append(RingRow(r.uid, slice(i, i + mine.size), paged=True))
            if r.logits != LOGITS_NONE:
                logit_rows.append(r.uid)
                logit_index.append(i)
        return cls(split, REPLICATED, len(rows), len(own), _ints([r.token_ids[0] for r in rows]),
                   _ints([r.start for r in rows]), _ints(slots), out_rows, _ints([]), _ints([]), 0, logit_rows,
                   _ints(logit_index), mx.ones((len(logit_rows),), dtype=mx.float32),
                   _paged_rows(paged, split.block_size), write_index=_ints(own))

    @classmethod
    def build(cls, rows: list[RowSpec], split: ContextSplit, algorithm: str) -> "ContextBatch":
        if algorithm == REPLICATED:
            return cls.replicated(rows, split)
        n, me = split.ranks, split.rank
        # How each rank holds each row: its share of a split row, all or nothing of a whole one.
        splits = [[row_split(split.for_rank(s), r.holder) for r in rows] for s in range(n)]
        ends = [r.start + len(r.token_ids) for r in rows]
        # Every rank's share of every row's new tokens, and of all it holds below the row's end.
        new = [[sp.held(r.start, e) for sp, r, e in zip(per, rows, ends)] for per in splits]
        shares = [sum(len(p) for p in per) for per in new]
        width = max(1, shares[me] if algorithm == LOCAL else max(shares))
        kv_counts = [[sp.local_count(e) for sp, e in zip(per, ends)] for per in splits]
        kv_width = max(1, max(sum(c) for c in kv_counts))

        tokens, positions, slots, out_rows = [], [], [], []
        q_first = [0] * n  # where each rank's next row starts among its `width` tokens
        kv_first = [0] * n  # pass-KV: where each rank's next row starts among its `kv_width` keys
        kv_local: list[mx.array] = []  # pass-KV: this rank's slots of each row, in position order
        q_order = np.full(n * width, -1, dtype=np.int64)  # pass-Q; -1: padding
        placed = 0  # pass-Q: partials computed so far, in row order
        paged: list[tuple[int, tuple[int, ...], int]] = []  # (query index, blocks, keys seen) of paged rows
        local_order: list[np.ndarray] = []  # local: see ContextBatch.out_order (-2 - j: paged row j)
        local_placed = 0
        logit_rows, logit_index, logit_mine = [], [], []
        for i, (r, end) in enumerate(zip(rows, ends)):
            mine = new[me][i]
            own = slice(len(tokens), len(tokens) + len(mine))
            tokens.extend(np.asarray(r.token_ids)[mine - r.start].tolist())
            positions.extend(mine.tolist())
            slots.extend(splits[me][i].slots(r.blocks, mine).tolist())
            row = RingRow(r.uid, own)
            if algorithm == LOCAL:
                if len(mine) == 1 and mine[0] == end - 1:  # a decode row: it sees every key held below its end
                    row.paged = True
                    local_order.append(np.array([-2 - len(paged)]))
                    paged.append((own.start, r.blocks, kv_counts[me][i]))
                elif len(mine):  # a row held elsewhere costs this rank nothing
                    local_order.append(local_placed + np.arange(len(mine)))
                    local_placed += len(mine)
                    row.kv_slots = row_slots(r.blocks, kv_counts[me][i], split.block_size)
                    row.blocks = query_blocks(mine, splits[me][i].held(0, end))
            elif algorithm == PASS_KV:
                # Its own KV straight from the pools (attended while the gather runs), the other ranks'
                # from the gathered keys; the two partials merge by log-sum-exp.
                row.kv_slots = row_slots(r.blocks, kv_counts[me][i], split.block_size)
                row.own_blocks = query_blocks(mine, splits[me][i].held(0, end))
                others = [s for s in range(n) if s != me]
                index = [s * kv_width + kv_first[s] + np.arange(kv_counts[s][i]) for s in others]
                at = np.concatenate([splits[s][i].held(0, end) for s in others])
                by_pos = np.argsort(at, kind="stable")
                row.kv_index = _ints(np.concatenate(index)[by_pos])
                row.blocks = query_blocks(mine, at[by_pos])
                kv_local.append(row.kv_slots)
            else:
                index = [s * width + q_first[s] + np.arange(len(new[s][i])) for s in range(n)]
                at = np.concatenate([new[s][i] for s in range(n)])
                by_pos = np.argsort(at, kind="stable")
                q_index = np.concatenate(index)[by_pos]
                if len(q_index) == 1 and at[0] == end - 1:  # a decode row: it sees every key held below its end
                    row.paged = True
                    q_order[q_index] = -2 - len(paged)
                    paged.append((int(q_index[0]), r.blocks, kv_counts[me][i]))
                else:
                    q_order[q_index] = placed + np.arange(len(q_index))
                    placed += len(q_index)
                    row.q_index = _ints(q_index)
                    row.kv_slots = row_slots(r.blocks, kv_counts[me][i], split.block_size)
                    row.blocks = query_blocks(at[by_pos], splits[me][i].held(0, end))
            for s in range(n):
                q_first[s] += len(new[s][i])
                kv_first[s] += kv_counts[s][i]
            out_rows.append(row)
            wanted = {LOGITS_NONE: [], LOGITS_LAST: [end - 1], LOGITS_ALL: range(r.start, end)}[r.logits]
            for p in wanted:
                at = int(np.searchsorted(mine, p))
                held_here = at < len(mine) and mine[at] == p
                logit_rows.append(r.uid)
                logit_index.append(own.start + at if held_here else 0)
                logit_mine.append(1.0 if held_here else 0.0)
        count = len(tokens)
        # The paged rows' partials follow the other rows'; padding reads the zero partial after them all.
        q_order[q_order <= -2] = placed + (-2 - q_order[q_order <= -2])
        q_order[q_order == -1] = placed + len(paged)
        out_order = np.concatenate(local_order) if local_order else np.zeros(0, dtype=np.int64)
        out_order[out_order <= -2] = local_placed + (-2 - out_order[out_order <= -2])
        sent = mx.concatenate(kv_local) if kv_local else _ints([])
        if algorithm == PASS_KV and sent.shape[0] < kv_width:  # padded with a slot it holds (or slot 0)
            filler = sent[:1] if sent.shape[0] else _ints([0])
            sent = mx.concatenate([sent, mx.repeat(filler, kv_width - sent.shape[0])])
        pad = width - count
        return cls(split, algorithm, width, count, _ints(tokens + [0] * pad), _ints(positions + [0] * pad),
                   _ints(slots), out_rows, _ints(q_order), sent, kv_width, logit_rows,
                   _ints(logit_index), mx.array(logit_mine, dtype=mx.float32), _paged_rows(paged, split.block_size),
                   _ints(out_order) if paged and algorithm == LOCAL else None)


def _paged_rows(rows: list[tuple[int, tuple[int, ...], int]], block_size: int) -> PagedRows | None:
    if not rows:
        return None
    seen = [s for _, _, s in rows]
    return PagedRows(_ints([q for q, _, _ in rows]), block_tables([b for _, b, _ in rows], seen, block_size),
                     _ints(seen))


def _ints(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.int32).reshape(-1))


def choose_algorithm(setting: str, rows: list[RowSpec], kv_heads: int, q_heads: int, min_new_for_kv: int) -> str:
    """Rows all kept whole (each on its holder) run LOCAL. Otherwise `auto` picks per step: REPLICATED
    when every row has one new token (decode); else Meta's heuristic: pass-KV when the step's new tokens
    are a large enough share of the KV they attend to
    (new / (new + cached) >= 2 * kv_heads / q_heads: then the KV that travels is smaller than the
    queries and outputs would be), or when there are enough new tokens for their attention to hide
    the KV transfer (`min_new_for_kv`, measured: docs/BENCHMARKS.md); else pass-Q (prefill chunks
    after a long cached prefix; decode steps when forced)."""
    if rows and all(r.holder >= 0 for r in rows):
        return LOCAL  # whatever the setting: nothing needs to travel
    if setting != "auto":
        return setting
    if rows and all(len(r.token_ids) == 1 for r in rows):
        return REPLICATED
    new = sum(len(r.token_ids) for r in rows)
    cached = sum(r.start for r in rows)
    if new == 0:
        return PASS_Q
    if new / (new + cached) >= 2 * kv_heads / q_heads or new >= min_new_for_kv:
        return PASS_KV
    return PASS_Q
