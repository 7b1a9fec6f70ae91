"""Exact attention from partials (model/ring_attention.py, the backends' `partial`): merging partial
attentions over disjoint key sets by log-sum-exp equals full attention, with extreme scores and with a
partial that has no keys; the CPU and portable backends agree; the per-step algorithm heuristic."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

from meshlm.engine.plan import LOGITS_LAST
from meshlm.kv.context_split import ContextSplit
from meshlm.model import cpu_kernels
from meshlm.model.attention import CPUBackend, PortableBackend, attend_exact, merge_partials
from meshlm.model.batch import RowSpec
from meshlm.model.context_batch import (LOCAL, PASS_KV, PASS_Q, REPLICATED, ContextBatch, choose_algorithm,
                                         query_blocks)
from meshlm.model.ring_attention import attend_blocks

H, HK, D = 4, 2, 16


def _backends():
    out = [PortableBackend()]
    native, _ = cpu_kernels.native_ops()
    if native is not None and hasattr(native, "softmax2_lse"):
        out.append(CPUBackend(native))
    return out


def _full(q, q_pos, k, v, k_pos, scale):
    """Reference: plain causal softmax attention in float64 numpy."""
    qn, kn, vn = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros_like(qn)
    r = H // HK
    for i in range(qn.shape[0]):
        for h in range(H):
            seen = k_pos <= q_pos[i]
            s = (kn[seen, h // r] @ qn[i, h]) * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ vn[seen, h // r]
    return out


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("length, n", [(300, 70), (700, 300)])  # one query block; three (one call, compiled)
def test_merged_partials_over_a_split_sequence_equal_full_attention(backend, ranks, length, n):
    rng = np.random.default_rng(ranks)
    # the last n positions are queries, as in a prefill chunk after a cached prefix
    k = rng.standard_normal((length, HK, D)).astype(np.float32)
    v = rng.standard_normal((length, HK, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32) * 3
    q_pos = np.arange(length - n, length)
    want = _full(q, q_pos, k, v, np.arange(length), 0.25)
    parts = []
    for r in range(ranks):
        held = ContextSplit(ranks, r, 8).held(0, length)
        parts.append(attend_blocks(mx.array(q), mx.array(k[held]), mx.array(v[held]), query_blocks(q_pos, held),
                                   backend, 0.25))
    got, _ = merge_partials(parts)
    assert np.abs(np.array(got) - want).max() < 2e-5


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
def test_extreme_scores_and_a_partial_without_keys(backend):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((40, HK, D)).astype(np.float32)
    v = rng.standard_normal((40, HK, D)).astype(np.float32)
    q = rng.standard_normal((5, H, D)).astype(np.float32) * 60  # scores in the thousands
    q_pos = np.array([0, 1, 2, 39, 39])
    want = _full(q, q_pos, k, v, np.arange(40), 1.0)
    early, late = np.arange(0, 3), np.arange(3, 40)
    a = attend_blocks(mx.array(q), mx.array(k[early]), mx.array(v[early]), query_blocks(q_pos, early), backend, 1.0)
    b = attend_blocks(mx.array(q), mx.array(k[late]), mx.array(v[late]), query_blocks(q_pos, late), backend, 1.0)
    # queries 0..2 see no key of the second part: a log-sum-exp of -inf (or, from the CPU kernel's
    # masked scores, about -7e29), which merges as no contribution
    assert (np.array(b[1])[:3] < -1e29).all() and np.isfinite(np.array(b[0])).all()
    got, lse = merge_partials([a, b])
    assert np.isfinite(np.array(lse)).all()
    assert np.abs(np.array(got) - want).max() < 1e-4
    empty = merge_partials([(mx.zeros((2, H, D)), mx.full((2, H), -mx.inf))])[0]
    assert np.array(empty).tolist() == np.zeros((2, H, D)).tolist()


def test_cpu_and_portable_partials_agree_on_lse():
    native, _ = cpu_kernels.native_ops()
    if native is None or not hasattr(native, "softmax2_lse"):
        pytest.skip("the compiled _cpu_ops module is not built here")
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((9, H, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((HK, 33, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((HK, 33, D)).astype(np.float32))
    mask = mx.array(np.tril(np.ones((9, 33), dtype=bool), 24))
    a = CPUBackend(native).partial(q, k, v, mask, 0.3)
    b = attend_exact(q, k, v, 0.3, mask)
    assert np.abs(np.array(a[0]) - np.array(b[0])).max() < 1e-5
    assert np.abs(np.array(a[1]) - np.array(b[1])).max() < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 80), (16, 2, 128)])
def test_the_compiled_partial_with_counts_equals_the_masked_one(heads, kv_heads, head_dim):
    """A CPU rank's partial attention given each query's count of visible keys (a prefix of the position-
    sorted keys, what a causal mask over them means) runs the compiled kernel: the same output and log-sum-
    exp as the masked MLX ops, zeros and -inf for a query that sees no key."""
    native, _ = cpu_kernels.native_ops()
    if native is None or not native.packed_gemm:
        pytest.skip("the compiled _cpu_ops module is not built here")
    rng = np.random.default_rng(heads + head_dim)
    n, S = 29, 70
    q = mx.array(rng.standard_normal((n, heads, head_dim)).astype(np.float32) * 2)
    k = mx.array(rng.standard_normal((kv_heads, S, head_dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((kv_heads, S, head_dim)).astype(np.float32))
    counts = np.sort(rng.integers(0, S + 1, n)).astype(np.int32)
    counts[:3] = 0  # queries before every key of this part
    mask = mx.array(np.arange(S)[None] < counts[:, None])
    got = CPUBackend(native).partial(q, k, v, mask, 0.3, mx.array(counts))
    want = attend_exact(q, k, v, 0.3, mask)
    assert np.abs(np.array(got[0]) - np.array(want[0])).max() < 5e-5  # float32 sums in another order
    lse_got, lse_want = np.array(got[1]), np.array(want[1])
    assert (lse_got[:3] == -np.inf).all() and (lse_want[:3] == -np.inf).all()
    assert np.abs(lse_got[3:] - lse_want[3:]).max() < 1e-4
    assert (np.array(got[0])[:3] == 0).all()


def _rows(new: int, cached: int) -> list[RowSpec]:
    return [RowSpec(1, cached, tuple([5] * new), (0,), LOGITS_LAST)]


def test_heuristic_at_and_around_its_thresholds():
    # kv_heads 2, q_heads 8: pass-KV once new / (new + cached) >= 2 * 2 / 8 = 0.5
    assert choose_algorithm("auto", _rows(1000, 1000), 2, 8, 1 << 30) == PASS_KV  # exactly 0.5
    assert choose_algorithm("auto", _rows(999, 1001), 2, 8, 1 << 30) == PASS_Q
    assert choose_algorithm("auto", _rows(1001, 999), 2, 8, 1 << 30) == PASS_KV
    # enough new tokens to hide the KV transfer: pass-KV whatever the cached share
    assert choose_algorithm("auto", _rows(4096, 100000), 2, 8, 4096) == PASS_KV
    assert choose_algorithm("auto", _rows(4095, 100000), 2, 8, 4096) == PASS_Q
    assert choose_algorithm("auto", _rows(1, 5000), 2, 8, 4096) == REPLICATED  # decode: one token a row
    assert choose_algorithm("pass-q", _rows(1, 5000), 2, 8, 4096) == PASS_Q
    assert choose_algorithm("pass-q", _rows(5000, 0), 2, 8, 1) == PASS_Q  # forced
    assert choose_algorithm("pass-kv", _rows(1, 5000), 2, 8, 1 << 30) == PASS_KV


def test_rows_all_kept_whole_run_local_steps_of_each_ranks_own_tokens():
    rows = [RowSpec(1, 0, (5, 6, 7), (3,), LOGITS_LAST, holder=0), RowSpec(2, 4, (8,), (1, 2), LOGITS_LAST, holder=1)]
    assert choose_algorithm("pass-kv", rows, 2, 8, 1) == LOCAL  # whatever the setting
    split = rows + [RowSpec(3, 0, (9,), (0,), LOGITS_LAST)]
    assert choose_algorithm("auto", split, 2, 8, 1 << 30) == PASS_KV  # one split row: the ring runs
    for rank, own, slots in ((0, [0, 1, 2], [12, 13, 14]), (1, [4], [8])):
        b = ContextBatch.build(rows, ContextSplit(2, rank, 4), LOCAL)
        assert b.width == b.count == len(own)  # its own tokens, unpadded
        assert np.array(b.positions).tolist() == own and np.array(b.slots).tolist() == slots
        assert np.array(b.logit_mine).tolist() == ([1.0, 0.0] if rank == 0 else [0.0, 1.0])
        held = [r for r in b.rows if r.own.stop > r.own.start]
        assert [r.uid for r in held] == [rank + 1]
        if len(own) > 1:
            assert held[0].kv_slots.shape[0] == own[-1] + 1 and b.paged is None
        else:  # one query (a decode row): read in place from its blocks, every key it holds seen
            assert held[0].paged and np.array(b.paged.lengths).tolist() == [own[-1] + 1]
            assert np.array(b.paged.tables).tolist() == [[1, 2]] and np.array(b.out_order).tolist() == [0]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
def test_decode_partial_reads_each_rows_prefix_of_its_blocks_in_place(backend):
    """A CP rank's decode rows (one query each) attend in place in the pools to the first `lengths[i]`
    slots of their blocks: the output and log-sum-exp of the masked MLX ops on the gathered keys, long
    rows (cut into chunks by the compiled kernel) and a row with no key (zeros, -inf) included."""
    rng = np.random.default_rng(7)
    bs, slots, heads, kv_heads, dim = 16, 4096, 9, 3, 64
    pool_k = mx.array(rng.standard_normal((slots, kv_heads, dim)).astype(np.float32))
    pool_v = mx.array(rng.standard_normal((slots, kv_heads, dim)).astype(np.float32))
    lengths = [1, 0, 37, 700, 2000, 16]
    order = rng.permutation(slots // bs)
    width = max(-(-n // bs) for n in lengths)
    tables, used = [], 0
    for n in lengths:
        blocks = order[used:used + -(-n // bs)].tolist()
        used += len(blocks)
        tables.append(blocks + [0] * (width - len(blocks)))
    q = mx.array(rng.standard_normal((len(lengths), heads, dim)).astype(np.float32) * 2)
    out, lse = backend.decode_partial(q, pool_k, pool_v, mx.array(tables, dtype=mx.int32),
                                      mx.array(lengths, dtype=mx.int32), bs, 0.125)
    out, lse = np.array(out), np.array(lse)
    assert (out[1] == 0).all() and (lse[1] == -np.inf).all()
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        at = (np.array(tables[i])[:, None] * bs + np.arange(bs)).reshape(-1)[:n]
        k = mx.array(np.array(pool_k)[at].transpose(1, 0, 2))
        v = mx.array(np.array(pool_v)[at].transpose(1, 0, 2))
        want_out, want_lse = attend_exact(q[i:i + 1], k, v, 0.125)
        assert np.abs(out[i] - np.array(want_out)[0]).max() < 1e-5, (i, n)
        assert np.abs(lse[i] - np.array(want_lse)[0]).max() < 1e-4, (i, n)


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: type(b).__name__)
def test_decode_partial_never_reads_past_a_rows_keys(backend):
    """Slots past a row's length in its last block, and block 0 (the padding of a row this rank holds no
    key of), may hold another sequence's values, even inf: a row's output and the merge with another
    rank's partial stay finite. The portable path once gathered them and weighted them by zero (NaN)."""
    bs, dim = 4, 16
    rng = np.random.default_rng(3)
    pool_k = rng.standard_normal((8, HK, dim)).astype(np.float32)
    pool_v = pool_k.copy()
    pool_v[0:4] = np.inf  # block 0: another sequence's
    pool_v[6:8] = np.inf  # past row 0's two keys in its block 1
    q = mx.array(rng.standard_normal((2, H, dim)).astype(np.float32))
    out, lse = backend.decode_partial(q, mx.array(pool_k), mx.array(pool_v), mx.array([[1], [0]], dtype=mx.int32),
                                      mx.array([2, 0], dtype=mx.int32), bs, 0.3)
    merged, _ = merge_partials([(out, lse), (mx.ones((2, H, dim)), mx.zeros((2, H)))])
    assert np.isfinite(np.array(out)).all() and np.isfinite(np.array(merged)).all()
    assert np.allclose(np.array(merged)[1], 1.0)  # the row with no key here: the other rank's partial alone


def test_portable_decode_partial_gathers_each_row_alone():
    """One long row among short ones: the portable path's memory is the rows' keys, not rows x the longest
    row's (a padded gather of 32 rows beside one of 16K keys took ~1 GB, against ~26 MB)."""
    bs, long_len, rows, dim = 16, 16384, 32, 64
    blocks = long_len // bs + rows
    rng = np.random.default_rng(5)
    pool_k = mx.array(rng.standard_normal((blocks * bs, HK, dim)).astype(np.float32))
    pool_v = mx.array(rng.standard_normal((blocks * bs, HK, dim)).astype(np.float32))
    width = long_len // bs
    tables = [list(range(width))] + [[width + i] + [0] * (width - 1) for i in range(rows - 1)]
    lengths = [long_len] + [1] * (rows - 1)
    q = mx.array(rng.standard_normal((rows, H, dim)).astype(np.float32))
    mx.eval(pool_k, pool_v, q)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out, lse = PortableBackend().decode_partial(q, pool_k, pool_v, mx.array(tables, dtype=mx.int32),
                                                mx.array(lengths, dtype=mx.int32), bs, 0.125)
    mx.eval(out, lse)
    assert mx.get_peak_memory() - base < 4 * long_len * HK * dim * 4 * 2  # a few copies of the long row
    want, _ = attend_exact(q[5:6], pool_k[(width + 4) * bs:(width + 4) * bs + 1].transpose(1, 0, 2),
                           pool_v[(width + 4) * bs:(width + 4) * bs + 1].transpose(1, 0, 2), 0.125)
    assert np.abs(np.array(out[5]) - np.array(want)[0]).max() < 1e-6


def test_a_pass_q_step_reads_its_decode_rows_in_place_and_orders_their_partials_after_the_others():
    """Rows of one query go to one paged call; `q_order` then finds their partials after the other rows',
    and padding the zero partial after them all."""
    rows = [RowSpec(1, 7, (5,), (4, 9), LOGITS_LAST), RowSpec(2, 0, tuple(range(3, 9)), (1, 2), LOGITS_LAST),
            RowSpec(3, 12, (6,), (3, 5, 7, 8), LOGITS_LAST)]
    for rank in (0, 1):
        b = ContextBatch.build(rows, ContextSplit(2, rank, 4), PASS_Q)
        assert [r.paged for r in b.rows] == [True, False, True]
        assert b.rows[0].q_index is None and b.rows[1].q_index is not None
        order = np.array(b.q_order)
        others = int(b.rows[1].q_index.shape[0])  # the prompt row's partials come first
        paged_at = np.array(b.paged.q_index)
        assert order[paged_at].tolist() == [others, others + 1]
        assert sorted(order[order < others].tolist()) == list(range(others))
        assert (order[order > others + 1] == others + 2).all()  # padding
        # every key of its row this rank holds precedes the query: it sees them all
        kv = ContextSplit(2, rank, 4)
        assert np.array(b.paged.lengths).tolist() == [kv.local_count(8), kv.local_count(13)]


def test_a_decode_step_runs_every_rows_token_on_every_rank_and_writes_only_its_own():
    """Replicated (decode steps under auto): every rank runs the same tokens at the same positions, attends
    each row's query to the keys of the row it holds, writes K and V only for the tokens it holds, and
    needs no sum for the logits (every rank has every row)."""
    rows = [RowSpec(1, 9, (5,), (4, 9), LOGITS_LAST), RowSpec(2, 4, (8,), (1, 2), LOGITS_LAST, holder=1),
            RowSpec(3, 14, (6,), (3, 5, 7, 8), LOGITS_LAST)]
    assert choose_algorithm("auto", rows, 2, 8, 1 << 30) == REPLICATED
    built = [ContextBatch.build(rows, ContextSplit(2, rank, 4), REPLICATED) for rank in (0, 1)]
    for rank, b in enumerate(built):
        assert b.width == 3 and np.array(b.tokens).tolist() == [5, 8, 6]
        assert np.array(b.positions).tolist() == [9, 4, 14]
        assert np.array(b.logit_index).tolist() == [0, 1, 2] and b.logit_rows == [1, 2, 3]
        split = ContextSplit(2, rank, 4)
        held = [int(split.held(9, 10).size), rank == 1, int(split.held(14, 15).size)]
        assert np.array(b.write_index).tolist() == [i for i, h in enumerate(held) if h] and b.count == sum(held)
        seen = [split.local_count(10), 5 if rank == 1 else 0, split.local_count(15)]
        assert np.array(b.paged.lengths).tolist() == seen and np.array(b.paged.q_index).tolist() == [0, 1, 2]
    # each new token is written by exactly one rank
    assert sorted(np.concatenate([np.array(b.write_index) for b in built]).tolist()) == [0, 1, 2]
