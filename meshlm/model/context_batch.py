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
  rank after rank (`kv_width` each), and this rank's queries attend to all
  of it, exactly, with no merge;
- logits: the rank holding a wanted position contributes its hidden state,
  the others zeros, and one sum gives every rank every wanted row.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE
from meshlm.kv.context_split import ContextSplit
from meshlm.model.batch import RowSpec

PASS_KV, PASS_Q = "pass-kv", "pass-q"


@dataclass
class RingRow:
    """What this rank computes for one sequence of the step."""

    uid: int
    own: slice  # this rank's new tokens of the row among its `width` batch tokens
    own_positions: mx.array  # (len own,) their true positions
    q_index: mx.array  # pass-Q: the row's queries among the gathered ones (every rank's), ...
    q_positions: mx.array  # ... and their positions
    kv_slots: mx.array  # pass-Q: this rank's pool slots of the row, every position it holds below the end
    kv_positions: mx.array
    gathered_kv: mx.array  # pass-KV: the row's keys among the gathered ones (every rank's), ...
    gathered_positions: mx.array  # ... and their positions


@dataclass
class ContextBatch:
    split: ContextSplit
    algorithm: str  # PASS_KV or PASS_Q, the same on every rank
    width: int  # tokens each rank runs this step (the widest share; the rest is padding)
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

    @property
    def num_tokens(self) -> int:
        return self.width

    @classmethod
    def build(cls, rows: list[RowSpec], split: ContextSplit, algorithm: str) -> "ContextBatch":
        n, me = split.ranks, split.rank
        splits = [split.for_rank(r) for r in range(n)]
        ends = [r.start + len(r.token_ids) for r in rows]
        # Every rank's share of every row's new tokens, and of all it holds below the row's end.
        new = [[s.held(r.start, e) for r, e in zip(rows, ends)] for s in splits]
        width = max(1, max(sum(len(p) for p in per) for per in new))
        kv_counts = [[s.local_count(e) for e in ends] for s in splits]
        kv_width = max(1, max(sum(c) for c in kv_counts))

        tokens, positions, slots, out_rows = [], [], [], []
        q_first = [0] * n  # where each rank's next row starts among its `width` tokens
        kv_first = [0] * n
        q_order = np.full(n * width, -1, dtype=np.int64)  # -1: padding
        placed = 0  # partials computed so far, in row order
        logit_rows, logit_index, logit_mine = [], [], []
        for i, (r, end) in enumerate(zip(rows, ends)):
            mine = new[me][i]
            own = slice(len(tokens), len(tokens) + len(mine))
            tokens.extend(r.token_ids[p - r.start] for p in mine)
            positions.extend(int(p) for p in mine)
            slots.extend(int(x) for x in split.slots(r.blocks, mine))
            q_index, q_pos, g_index, g_pos = [], [], [], []
            for s in range(n):
                q_index.append(s * width + q_first[s] + np.arange(len(new[s][i])))
                q_pos.append(new[s][i])
                g_index.append(s * kv_width + kv_first[s] + np.arange(kv_counts[s][i]))
                g_pos.append(splits[s].held(0, end))
                q_first[s] += len(new[s][i])
                kv_first[s] += kv_counts[s][i]
            q_index_all = np.concatenate(q_index)
            q_order[q_index_all] = placed + np.arange(len(q_index_all))
            placed += len(q_index_all)
            held = split.held(0, end)
            out_rows.append(RingRow(r.uid, own, _ints(mine), _ints(q_index_all), _ints(np.concatenate(q_pos)),
                                    _ints(split.slots(r.blocks, held)), _ints(held),
                                    _ints(np.concatenate(g_index)), _ints(np.concatenate(g_pos))))
            wanted = {LOGITS_NONE: [], LOGITS_LAST: [end - 1], LOGITS_ALL: range(r.start, end)}[r.logits]
            for p in wanted:
                at = np.searchsorted(mine, p)
                held_here = at < len(mine) and mine[at] == p
                logit_rows.append(r.uid)
                logit_index.append(own.start + int(at) if held_here else 0)
                logit_mine.append(1.0 if held_here else 0.0)
        count = len(tokens)
        q_order[q_order < 0] = placed  # padding reads the zero partial appended after the rows'
        kv_local = [int(x) for r, e in zip(rows, ends) for x in split.slots(r.blocks, split.held(0, e))]
        kv_local += [kv_local[0] if kv_local else 0] * (kv_width - len(kv_local))
        pad = width - count
        return cls(split, algorithm, width, count, _ints(tokens + [0] * pad), _ints(positions + [0] * pad),
                   _ints(slots), out_rows, _ints(q_order), _ints(kv_local), kv_width, logit_rows,
                   _ints(logit_index), mx.array(logit_mine, dtype=mx.float32))


def _ints(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.int32).reshape(-1))


def choose_algorithm(setting: str, rows: list[RowSpec], kv_heads: int, q_heads: int, min_new_for_kv: int) -> str:
    """`auto` picks per step (Meta's heuristic): pass-KV when the step's new tokens are a large enough
    share of the KV they attend to (new / (new + cached) >= 2 * kv_heads / q_heads: then the KV that
    travels is smaller than the queries and outputs would be), or when there are enough new tokens
    for their attention to hide the KV transfer (`min_new_for_kv`, measured: docs/BENCHMARKS.md);
    else pass-Q (decode steps, prefill chunks after a long cached prefix)."""
    if setting != "auto":
        return setting
    new = sum(len(r.token_ids) for r in rows)
    cached = sum(r.start for r in rows)
    if new == 0:
        return PASS_Q
    if new / (new + cached) >= 2 * kv_heads / q_heads or new >= min_new_for_kv:
        return PASS_KV
    return PASS_Q
